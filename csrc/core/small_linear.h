#pragma once

// The linear layers of a decoding step: y = x W^T + b with only a few rows of x (a token per
// sequence), where the time is reading W. torchmha's CPU kernel streams W once at the machine's
// read rate; ATen's GEMM (MKL's matrix-vector path) reads it at a third of that on AMD EPYC
// (8.5 against 25 GB/s, benchmarks/README.md). Its own op (torchmha::small_linear) so that it has
// a kernel per device: the CPU kernel, and at::linear everywhere else (and for Meta/fake tensors).

#include "common.h"

#include <tuple>

namespace torchmha::core {

/// at::linear, through the small-batch op where it applies: inference (no gradient needed) with at
/// most kernel::kLinearMaxRows rows of x, or more in blocks of those where the CPU kernel's rule
/// says they beat the GEMM (cpu::small_linear_serves), float32/bfloat16/float16 on the CPU.
/// TORCHMHA_SMALL_LINEAR=0 keeps at::linear everywhere. With a `scale`, the weight is int8
/// (quantize_weight's) and the layer is the op torchmha::quantized_linear.
Tensor linear_layer(const Tensor& x, const Tensor& weight, const OptionalTensor& bias,
                    const OptionalTensor& scale = std::nullopt);

/// The op's kernels: the CPU kernel (at::linear where it does not apply) and the reference.
Tensor small_linear_cpu(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);
Tensor small_linear_reference(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);

// ------------------------------------------------------------------ int8 weights (weight-only)
// A decoding step reads every weight once per token: int8 weights read a quarter of float32's
// bytes, half of bfloat16's. Symmetric, one scale per output channel; activations stay in their
// dtype and the sums are taken in float.

/// {int8 weight, float32 scale (O,)} of a 2-D floating weight (O, K): scale = max|row| / 127 (1
/// for an all-zero row), weight = round(row / scale), within [-127, 127].
std::tuple<Tensor, Tensor> quantize_weight(const Tensor& weight);

/// Throws naming `what` (its parts, put together only for the message) unless `scale` fits
/// `weight`: int8 (O, K) with a float32 (O,) scale on its device, or a floating weight with no
/// scale. (A decoder step checks its 36 weights so, each named by layer and slot.)
template <typename... What>
void check_weight_scale(const Tensor& weight, const OptionalTensor& scale, const What&... what) {
  if (!is_present(scale)) {
    TORCH_CHECK_VALUE(weight.scalar_type() != at::kChar, what..., ": an int8 weight needs its scale (quantize_weight's)");
    return;
  }
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kChar && weight.dim() == 2, what..., ": a scale goes with an int8 ",
                    "(out_features, in_features) weight, but the weight is ", weight.scalar_type(), " of shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(scale->scalar_type() == at::kFloat && scale->dim() == 1 && scale->size(0) == weight.size(0) &&
                        scale->device() == weight.device(),
                    what..., ": expected a float32 scale of shape (", weight.size(0), ",) on ", weight.device(),
                    " for the int8 weight ", weight.sizes(), ", but got ", scale->scalar_type(), " of shape ",
                    scale->sizes(), " on ", scale->device());
}

/// The op quantized_linear's kernels: the reference dequantizes (weight * scale, in x's dtype)
/// and runs at::linear, on any device and differentiable in x; the CPU kernel reads the int8 rows
/// for a few rows of x (the reference elsewhere).
Tensor quantized_linear_reference(const Tensor& x, const Tensor& weight, const Tensor& scale,
                                  const OptionalTensor& bias);
Tensor quantized_linear_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale, const OptionalTensor& bias);

}  // namespace torchmha::core
