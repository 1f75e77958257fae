// Masks, extra key positions, attention and the output projection (attend.h).

#include "attend.h"

#include "in_projection.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>
#include <limits>

namespace torchmha::core {
namespace {

OptionalTensor pad_last_dim(const OptionalTensor& mask) {
  return is_present(mask) ? OptionalTensor(at::constant_pad_nd(*mask, {0, 1}, 0)) : std::nullopt;
}

// One more position along the length of (N, H, len, D), from `row` (1, 1, H * D).
Tensor append_position(const Tensor& heads, const Tensor& row) {
  const int64_t N = heads.size(0), H = heads.size(1), D = heads.size(3);
  return at::cat({heads, row.reshape({1, H, 1, D}).expand({N, H, 1, D})}, 2);
}

}  // namespace

OptionalTensor additive_mask(const OptionalTensor& mask, at::ScalarType dtype) {
  if (!is_present(mask) || mask->scalar_type() != at::kBool) {
    return mask;
  }
  return at::zeros_like(*mask, mask->options().dtype(dtype))
      .masked_fill_(*mask, -std::numeric_limits<double>::infinity());
}

OptionalTensor add_masks(const OptionalTensor& a, const OptionalTensor& b) {
  if (!is_present(a)) {
    return b;
  }
  return is_present(b) ? OptionalTensor(*a + *b) : a;
}

OptionalTensor padding_bias(const OptionalTensor& key_padding_mask, int64_t batch, const c10::SymInt& src_len,
                            at::ScalarType dtype) {
  auto additive = additive_mask(key_padding_mask, dtype);
  if (!is_present(additive)) {
    return std::nullopt;
  }
  return additive->view_symint({batch, 1, 1, src_len});
}

KeysValues append_extra_key_positions(KeysValues kv, const AttentionWeights& weights) {
  if (is_present(weights.bias_k)) {
    kv.keys = append_position(kv.keys, *weights.bias_k);
    kv.values = append_position(kv.values, *weights.bias_v);
    kv.attn_mask = pad_last_dim(kv.attn_mask);
    kv.padding_mask = pad_last_dim(kv.padding_mask);
  }
  if (weights.add_zero_attn) {  // one all-zero key/value position: a zero pad of the length
    kv.keys = at::constant_pad_nd(kv.keys, {0, 0, 0, 1}, 0);
    kv.values = at::constant_pad_nd(kv.values, {0, 0, 0, 1}, 0);
    kv.attn_mask = pad_last_dim(kv.attn_mask);
    kv.padding_mask = pad_last_dim(kv.padding_mask);
  }
  return kv;
}

Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask, double dropout_p,
              bool is_causal) {
  return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal);
}

std::pair<Tensor, Tensor> attend_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const OptionalTensor& mask, double dropout_p) {
  // bmm over the N*H heads (reshape copies strided heads once; 4-D matmul would add more ops).
  // The 1/sqrt(D) scale is the GEMM's alpha rather than a pass over q (torch scales q; the two
  // agree to rounding, exactly when D is a power of 4). beta = 0 ignores the input, so a
  // zero-stride placeholder serves.
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto ignored_input = at::empty({1, 1, 1}, q.options()).expand({N * H, L, S});
  auto scores = at::baddbmm(ignored_input, q.reshape({N * H, L, D}), k.reshape({N * H, S, D}).transpose(1, 2),
                            /*beta=*/0, /*alpha=*/scale)
                    .view({N, H, L, S});
  // In place on the GEMM's fresh output (its backward reads only its inputs): spares an
  // N*H*L*S allocation.
  if (is_present(mask)) {
    scores.add_(*mask);
  }
  auto weights = at::softmax(scores, -1);
  if (dropout_p > 0.0) {
    weights = at::dropout(weights, dropout_p, /*train=*/true);
  }
  auto output = at::bmm(weights.reshape({N * H, L, S}), v.reshape({N * H, S, D})).view({N, H, L, D});
  return {output, weights};
}

Tensor project_output(const Tensor& heads, const AttentionWeights& weights, bool batch_first, bool contiguous) {
  // torch's slow path computes the output sequence first, (L, N, E), and returns batch_first as its
  // transposed view; its fused path returns (N, L, E) contiguous. The same strides here, so a
  // dropout after the attention draws the same mask under a seed.
  if (batch_first && contiguous) {
    return at::linear(heads.transpose(1, 2).flatten(-2), weights.out_weight, weights.out_bias);
  }
  auto output = at::linear(merge_heads(heads), weights.out_weight, weights.out_bias);
  return batch_first ? output.transpose(0, 1) : output;
}

}  // namespace torchmha::core
