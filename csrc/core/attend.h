#pragma once

// The steps after the in-projection: masks, extra key positions, attention itself (explicit
// weights or SDPA) and the output projection. Heads are (N, H, len, D) throughout.

#include "arguments.h"

#include <c10/core/SymInt.h>

#include <initializer_list>
#include <utility>

namespace torchmha::core {

// ---- masks: additive float masks broadcastable to (N, H, L, S); absent is nullopt.

/// A bool mask (true = not allowed) becomes an additive mask of `dtype` (-inf where true); a
/// float mask passes through. The kind was checked in validate.
OptionalTensor additive_mask(const OptionalTensor& mask, at::ScalarType dtype);
/// a + b, either of which may be absent.
OptionalTensor add_masks(const OptionalTensor& a, const OptionalTensor& b);
/// key_padding_mask (N, S) -> additive (N, 1, 1, S).
OptionalTensor padding_bias(const OptionalTensor& key_padding_mask, int64_t batch, const c10::SymInt& src_len,
                            at::ScalarType dtype);
// ---- extra key positions

/// Keys and values with bias_k/bias_v and the add_zero_attn position appended along the length,
/// and the masks padded to match (the new positions are never masked).
struct KeysValues {
  Tensor keys, values;
  OptionalTensor attn_mask, padding_mask;
};
KeysValues append_extra_key_positions(KeysValues kv, const AttentionWeights& weights);

// ---- whether a kernel of torchmha's (raw pointers, no derivative formula) may take tensors

/// Forward-mode tangents, function transforms (vmap, jvp) or dispatch modes (tracing) on any of
/// `tensors` (an undefined one counts as none): the kernels have no rules for them.
bool transformed(std::initializer_list<Tensor> tensors);
/// Whether autograd records a graph through any of `tensors`.
bool records_grad(std::initializer_list<Tensor> tensors);

// ---- attend

/// softmax(q k^T / sqrt(D) + mask) v through at::scaled_dot_product_attention: the L x S weights
/// are never materialized. `is_causal` is SDPA's (top-left aligned). `batch_major` asks for the
/// heads in (N, L, H, D) memory where a kernel of torchmha's writes them (common/heads_layout.h):
/// the order of batch_first's contiguous output.
Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask, double dropout_p,
              bool is_causal = false, bool batch_major = false);

/// attend over fixed keys and values with a key padding mask (N, 1, 1, S) or none: a decoder's
/// memory. torchmha's static_attention where no gradient, dropout or transform is asked and its
/// kernel pays off for T rows over S keys (cpu::static_kernel_pays_off), else attend.
Tensor attend_fixed_keys(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& padding,
                         double dropout_p);
/// The same with explicit weights, which are part of the result: {output heads, weights}, the
/// weights (N, L, S) averaged over the heads or (N, H, L, S) (explicit_attention.h).
std::pair<Tensor, Tensor> attend_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const OptionalTensor& mask, double dropout_p, bool average,
                                              bool batch_major = false);

// ---- output projection

/// Heads (N, H, L, D) merged and through out_proj: (L, N, E_out), or with batch_first its
/// transposed view (N, L, E_out), torch's layout; (N, L, E_out) contiguous with `contiguous`
/// (the layout of torch's fused path).
Tensor project_output(const Tensor& heads, const AttentionWeights& weights, bool batch_first,
                      bool contiguous = false);
/// Whether project_output reads the heads in (N, L, H, D) order, the `batch_major` that attend
/// and attend_with_weights take; (L, N, H, D) otherwise. Heads in that order merge without a copy.
inline bool output_reads_batch_major(bool batch_first, bool contiguous) {
  return batch_first && contiguous;
}

}  // namespace torchmha::core
