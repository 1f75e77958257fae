#pragma once

// torchmha's own CPU kernels as the device-generic pipeline (csrc/core) sees them: the one header
// of csrc/cpu/ that the core includes. Each kernel returns its result, or nullopt where it does not
// take the inputs (a dtype, an instruction set, shapes or strides it cannot read through raw
// pointers, a setting that turns it off); the core then runs the op's ATen composition, its
// reference. The *_pays_off rules say where a kernel beats the composition or SDPA on this CPU:
// measured, keyed on the CPU facts of cpu_capability.h, each forced by a TORCHMHA_* setting
// (docs/kernel_rules.md). The shapes are those of the ops (csrc/core/<op>.h). A CUDA kernel would
// get a folder of its own, csrc/cuda/, with a header like this one.

#include "common/optional_tensor.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace torchmha::cpu {

using at::Tensor;

// ---------------------------------------------------------------- attention without weights
// (blocked_attention_kernel.cpp: flash attention's running softmax over blocks of keys)

/// Whether the kernel takes these inputs: CPU, float32/bfloat16/float16, AVX2 or AVX-512, shapes
/// that agree, rows contiguous along D, a mask of q's dtype with contiguous rows.
bool blocked_kernel_applies(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask);
/// Whether it beats SDPA for this size, dtype and CPU, forward only or with the backward.
/// TORCHMHA_BLOCKED_KERNEL=1 takes it wherever it applies, 0 never.
bool blocked_kernel_pays_off(const Tensor& q, const Tensor& k, bool is_causal, bool with_grad);
/// Where SDPA runs instead: whether it gets q, k and v as contiguous (N, H, L, D) copies rather than
/// views of the projection (its GEMMs read a head's rows adjacent). TORCHMHA_SDPA_CONTIGUOUS=1
/// copies wherever q is a float CPU tensor, 0 never.
bool sdpa_takes_contiguous_heads(const Tensor& q, const Tensor& k, bool is_causal, bool with_grad);
/// {heads, log-sum-exp}, as the op torchmha::blocked_attention.
std::optional<std::tuple<Tensor, Tensor>> blocked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                                            const OptionalTensor& mask, bool is_causal,
                                                            bool batch_major);
/// {dq, dk, dv}, as the op torchmha::blocked_attention_backward.
std::optional<std::tuple<Tensor, Tensor, Tensor>> blocked_attention_backward(
    const Tensor& grad_heads, const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
    bool is_causal, const Tensor& heads, const Tensor& lse);

// ---------------------------------------------------------------- attention with weights
// (explicit_attention_kernel.cpp: blocks of query rows, the scores of one block at a time)

/// Whether the kernels serve this device and dtype (CPU, float or double, AVX2/AVX-512).
bool explicit_kernel_serves(const at::Device& device, at::ScalarType dtype);
/// Whether they take these inputs (served, shapes that agree, rows read in place).
bool explicit_kernel_applies(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask);
/// Whether a head's L x S scores are many enough for them (every size, unless
/// TORCHMHA_MIN_KERNEL_SCORES sets a threshold).
bool explicit_kernel_pays_off(int64_t L, int64_t S);
/// {heads, weights}, as the op torchmha::attention_with_weights.
std::optional<std::tuple<Tensor, Tensor>> attention_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                 const OptionalTensor& mask, bool average,
                                                                 bool batch_major);
/// Its backward where explicit_kernel_applies: {dq, dk, dv}, the probabilities recomputed block by
/// block; an undefined gradient is an unused output.
std::tuple<Tensor, Tensor, Tensor> attention_with_weights_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                   const OptionalTensor& mask, bool average,
                                                                   const Tensor& grad_heads,
                                                                   const Tensor& grad_weights);

// ---------------------------------------------------------------- a decoding step
// (decode_attention_kernel.cpp: one pass over the filled prefix per sequence and head)

/// The op torchmha::decode_attention on shapes already checked: the cache written, the attention
/// over each sequence's prefix, lengths advanced (float, double, bfloat16/float16 computed in
/// float; no dropout; TORCHMHA_DECODE_KERNEL_MAX_ROWS limits the new rows). The lengths are
/// checked first, with the numbers, whether the kernel then takes the step or not.
std::optional<Tensor> decode_attention(const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                                       const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                                       const OptionalTensor& new_lengths, const OptionalTensor& padding,
                                       double dropout_p);
/// The op torchmha::static_attention: q's rows over fixed keys and values (a decoder's memory), each
/// row over every key, the same pass per (sequence, head) without a cache write.
std::optional<Tensor> static_attention(const Tensor& q, const Tensor& keys, const Tensor& values,
                                       const OptionalTensor& padding);
/// Whether that kernel beats SDPA for T query rows over S keys (TORCHMHA_STATIC_KERNEL forces it).
bool static_kernel_pays_off(int64_t T, int64_t S);
/// The two passes into `out` (q's shape, contiguous), for a step whose buffers are made once
/// (CachedDecoder's kernel step): decode_attention without new_lengths, dropout or a prefill, and
/// lengths not advanced (the lengths checked as above); false, with nothing written, where the
/// kernel does not take the call.
bool decode_attention_into(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                           const Tensor& v_cache, const Tensor& lengths, const Tensor& out);
bool static_attention_into(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding,
                           const Tensor& out);

// ---------------------------------------------------------------- linear layers of a few rows
// (small_linear_kernel.cpp: each weight row read once, at the read rate)

/// Whether the kernel may take x's rows against `weight`: at most its limit, or in blocks of that up
/// to the rule's (blocked_rows), unless TORCHMHA_SMALL_LINEAR=0.
bool small_linear_serves(const Tensor& x, const Tensor& weight);
/// y = x W^T + b, as the op torchmha::small_linear (float32/bfloat16/float16).
std::optional<Tensor> small_linear(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);
/// y = (x W^T) * scale + b with W int8 (O, K) and scale (O,) float32, as the op
/// torchmha::quantized_linear: each int8 row read once, the sum taken in float.
std::optional<Tensor> quantized_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                                       const OptionalTensor& bias);
/// Either of the two into `y` (x's rows by the weight's, contiguous, x's dtype), for up to
/// kLinearMaxRows rows (scale present: int8 weights); false where the kernel hands the call back
/// (y then unspecified).
bool small_linear_into(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias,
                       const Tensor& y);

// ---------------------------------------------------------------- a residual's LayerNorm
// (residual_norm_kernel.cpp: one pass over a decoding step's few rows)

/// layer_norm(x + y) over the last dimension, as ATen's add then layer_norm give it (the sum
/// rounded to x's dtype first): float32/bfloat16/float16, x and y of one shape, contiguous, up to 8
/// rows (a decoding step's), weight and bias of x's dtype or absent. TORCHMHA_RESIDUAL_NORM=0
/// declines every call.
std::optional<Tensor> residual_layer_norm(const Tensor& x, const Tensor& y, const OptionalTensor& weight,
                                          const OptionalTensor& bias, double eps);
/// The same into `out` (x's shape, contiguous; it may be x or y itself: each element is read
/// before it is written); false, with nothing written, where the kernel declines.
bool residual_layer_norm_into(const Tensor& x, const Tensor& y, const OptionalTensor& weight,
                              const OptionalTensor& bias, double eps, const Tensor& out);

}  // namespace torchmha::cpu
