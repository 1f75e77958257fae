#pragma once

// The linear layers of a decoding step: y = x W^T + b with only a few rows of x (a token per
// sequence), where the time is reading W. torchmha's CPU kernel streams W once at the machine's
// read rate; ATen's GEMM (MKL's matrix-vector path) reads it at a third of that on AMD EPYC
// (8.5 against 25 GB/s, benchmarks/README.md). Its own op (torchmha::small_linear) so that it has
// a kernel per device: the CPU kernel, and at::linear everywhere else (and for Meta/fake tensors).

#include "common.h"

namespace torchmha::core {

/// at::linear, through the small-batch op where it applies: inference (no gradient needed) with at
/// most kernel::kLinearMaxRows rows of x, float32/bfloat16/float16 on the CPU.
/// TORCHMHA_SMALL_LINEAR=0 keeps at::linear everywhere.
Tensor linear_layer(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);

/// The op's kernels: the CPU kernel (at::linear where it does not apply) and the reference.
Tensor small_linear_cpu(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);
Tensor small_linear_reference(const Tensor& x, const Tensor& weight, const OptionalTensor& bias);

}  // namespace torchmha::core
