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
  bool weights_to_l2 = false;  // prefetch the weights into L2 only, not L1 (the AVX-512 copy)
  bool half_pairs = false;     // float16 weights two features a pass from 6 rows (the AVX-512 copy)
  bool prefetch_in_order = false;  // prefetch_offset's block where it holds (small_linear_kernel.cpp)
};

/// Where a pass over F features prefetches feature f's weights at column k, from `ahead` (the same
/// position, some rows on), in weights: at column k of each row (row stride `stride`), or, where
/// the rows ahead are one block (rows one after another, and a pass reads each of them whole,
/// possibly over several spans of K in turn), its lines front to back: F k + step f, `step` the
/// weights one prefetch covers. The same lines; in order they are one sequential stream, which the
/// L2's own prefetcher follows. Measured on the AVX2 copy (AMD EPYC Zen 3), where the interleaved
/// order kept reads and arithmetic from overlapping, and on Zen 4 (small_linear_kernel.cpp's
/// prefetch_in_order says where): docs/kernel_rules.md, the prefetches' order.
constexpr int64_t prefetch_offset(bool one_block, int F, int f, int64_t k, int64_t step, int64_t stride) {
  return one_block ? F * k + step * f : stride * f + k;
}

constexpr int64_t kLinearMaxRows = 8;
/// linear_rows: output features [begin, end) of `p`, for every row of x (M at most kLinearMaxRows).
/// to_float: n bfloat16 or float16 values as float32 (exactly), with this instruction set's
/// conversions (x for the float loop).
namespace avx2 {
void linear_rows(const LinearProblem<float>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<float, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half, int8_t>& p, int64_t begin, int64_t end);
void to_float(const c10::BFloat16* x, int64_t n, float* out);
void to_float(const c10::Half* x, int64_t n, float* out);
}  // namespace avx2
namespace avx512 {
void linear_rows(const LinearProblem<float>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<float, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::BFloat16, int8_t>& p, int64_t begin, int64_t end);
void linear_rows(const LinearProblem<c10::Half, int8_t>& p, int64_t begin, int64_t end);
void to_float(const c10::BFloat16* x, int64_t n, float* out);
void to_float(const c10::Half* x, int64_t n, float* out);
}  // namespace avx512

/// bfloat16 x against bfloat16 weights, or int8 weights with one float scale per row (each 32
/// converted to bfloat16, exactly), on AVX512-BF16 (linear_kernel_bf16.cpp): y = x W^T (* scale)
/// + b with vdpbf16ps, bfloat16 values as their bits.
template <typename weight_t>
struct BFloat16Problem {
  const uint16_t* x;     // (M, K), contiguous
  const weight_t* w;     // (O, K): bfloat16 bits or int8; rows contiguous, row stride w_stride
  int64_t w_stride;
  const float* scale;    // (O,) for int8 weights, else null
  const uint16_t* bias;  // (O,) or null
  uint16_t* y;           // (M, O), contiguous
  int64_t M, K, O;
  int features_a_pass = 1;  // 1 or 2 (small_linear_kernel.cpp: bfloat16_features_a_pass)
  bool prefetch_in_order = false;  // as LinearProblem's
};

namespace avx512_bf16 {
/// Output features [begin, end); M is at most kLinearMaxRows.
void bfloat16_rows(const BFloat16Problem<uint16_t>& p, int64_t begin, int64_t end);
void bfloat16_rows(const BFloat16Problem<int8_t>& p, int64_t begin, int64_t end);
}  // namespace avx512_bf16

/// x as exact integers for int8 weights on AVX512-VNNI (linear_kernel_vnni.cpp): row m is
/// u_m * steps[m] with u_m = sum_l digits[m][l] 256^l, each digit in [-128, 127], and sums[m] the
/// sum of u_m over the row. Digit rows are padded_k long (K rounded up to 64), zero past K.
constexpr int kDigits = 4;
struct IntegerRows {
  int8_t* digits;  // (M, kDigits, padded_k)
  int64_t padded_k;
  double* steps;   // (M,)
  int64_t* sums;   // (M,)
};

/// y (M, O) in float = scale[o] * sum_k W[o, k] x[m, k] + bias[o], with x as IntegerRows.
struct IntegerProblem {
  IntegerRows x;
  const int8_t* w;     // (O, K), rows contiguous, row stride w_stride
  int64_t w_stride;
  const float* scale;  // (O,)
  const float* bias;   // (O,) or null
  float* y;            // (M, O), contiguous
  int64_t M, K, O;
};

/// M is at most kIntegerMaxRows; K at most kIntegerMaxK, so that the int32 sums cannot overflow
/// (each lane gains at most 4 * 255 * 128 per 64 columns).
constexpr int64_t kIntegerMaxRows = 4;
constexpr int64_t kIntegerMaxK = int64_t(1) << 20;
namespace avx512_vnni {
/// Fills `out` (its buffers sized for M rows); false if x holds an inf or a NaN (no integers).
bool integer_rows(const float* x, int64_t M, int64_t K, IntegerRows& out);
void quantized_rows(const IntegerProblem& p, int64_t begin, int64_t end);
}  // namespace avx512_vnni

/// One row of x as exact 16-bit digits for int8 weights on AVX2 (linear_kernel_int16.cpp): x is
/// u * step with u = digits[0][k] 2^15 + digits[1][k], the high digit in [-2^14, 2^14], the low in
/// [0, 2^15). Digit rows are padded_k long (K rounded up to 16), zero past K.
struct Int16Rows {
  int16_t* digits;  // (2, padded_k)
  int64_t padded_k;
  double step;
};

/// y (1, O) in float = scale[o] * sum_k W[o, k] x[k] + bias[o], with x as Int16Rows.
struct Int16Problem {
  Int16Rows x;
  const int8_t* w;     // (O, K), rows contiguous, row stride w_stride
  int64_t w_stride;
  const float* scale;  // (O,)
  const float* bias;   // (O,) or null
  float* y;            // (O,)
  int64_t K, O;
};

namespace avx2_int16 {
/// Fills `out` (its digits sized for padded_k); false if x holds an inf or a NaN, or its largest
/// |x| is below 2^-98 (no digits: the float loop runs).
bool int16_row(const float* x, int64_t K, Int16Rows& out);
/// Output features [begin, end).
void quantized_row(const Int16Problem& p, int64_t begin, int64_t end);
}  // namespace avx2_int16

/// The small-batch linear on AMX tiles (linear_kernel_amx.cpp), 16 output features a tile product,
/// every row of x (up to kLinearMaxRows) at once.
namespace amx {
/// bfloat16 x (M rows, K a multiple of 32) as the bfloat16 tiles' B operand, into `packed`:
/// K * M / 2 words.
void pack_rows(const uint16_t* x, int64_t M, int64_t K, uint32_t* packed);
/// Output features [16 begin, 16 end) of `p` (AMX-BF16), from pack_rows' x.
void bfloat16_tiles(const BFloat16Problem<uint16_t>& p, const uint32_t* packed, int64_t begin, int64_t end);
/// float16 x (bits; M rows, K a multiple of 32) split into bfloat16 halves (`halves`: 2 M K values)
/// and packed as the float16 tiles' B operand, into `packed`: K * M words.
void pack_halves(const uint16_t* x, int64_t M, int64_t K, uint16_t* halves, uint32_t* packed);
/// Output features [16 begin, 16 end) of `p` (float16 bits in BFloat16Problem's layout) on AMX-BF16,
/// from pack_halves' x.
void float16_tiles(const BFloat16Problem<uint16_t>& p, const uint32_t* packed, int64_t begin, int64_t end);
/// x's integer digits (M rows, padded_k a multiple of 64) as the int8 tiles' B operands, into
/// `packed`: padded_k * M words.
void pack_digits(const IntegerRows& x, int64_t M, uint32_t* packed);
/// Output features [16 begin, 16 end) of `p` (AMX-INT8; p.K a multiple of 64, at most
/// kIntegerTilesMaxK; p.x.steps readable for M entries), from pack_digits' x.
void integer_tiles(const IntegerProblem& p, const uint32_t* packed, int64_t begin, int64_t end);
/// (each int32 sum gains at most 128 * 128 a column: 2^16 columns stay below 2^31)
constexpr int64_t kIntegerTilesMaxK = int64_t(1) << 16;
}  // namespace amx

}  // namespace torchmha::cpu::kernel
