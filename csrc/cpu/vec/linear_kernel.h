#pragma once

// The inner loop of torchmha's small-batch linear kernel (small_linear_kernel.cpp), on raw pointers:
// y = x W^T + b for a few rows of x, where the time is reading W once. Built for AVX2/FMA and for
// AVX-512 (linear_kernel_{avx2,avx512}.cpp with linear_kernel_impl.h), like decode_kernel.h, and
// like it includes nothing of ATen's.

#include <cstdint>

namespace c10 {  // (declared only: bfloat16 and float16 weights, computed in float)
struct BFloat16;
struct Half;
}  // namespace c10

namespace torchmha::cpu::kernel {

/// M rows of x against the rows of W: W in the activations' dtype, or int8 with one float scale per
/// row (weight-only quantization: y[m, o] = scale[o] * sum_k W[o, k] x[m, k] + b[o]).
template <typename scalar_t, typename weight_t = scalar_t>
struct LinearProblem {
  const float* x;         // (M, K), contiguous, in float (converted once)
  const weight_t* w;      // (O, K), rows contiguous, row stride w_stride
  int64_t w_stride;
  const float* scale;     // (O,) for int8 weights, else null
  const scalar_t* bias;   // (O,) or null
  scalar_t* y;            // (M, O), contiguous
  int64_t M, K, O;
};

/// Output features [begin, end) of `p`, for every row of x. M is at most kLinearMaxRows.
constexpr int64_t kLinearMaxRows = 8;
namespace avx2 {
void linear_rows(const LinearProblem<float>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<float, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half, int8_t>& p, int64_t begin, int64_t end);
}  // namespace avx2
namespace avx512 {
void linear_rows(const LinearProblem<float>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<float, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half, int8_t>& p, int64_t begin, int64_t end);
}  // namespace avx512

}  // namespace torchmha::cpu::kernel
