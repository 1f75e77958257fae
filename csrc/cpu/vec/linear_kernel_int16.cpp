// int8 weights against one row of x held as exact 16-bit digits (linear_kernel.h, "Int16Rows"),
// built for AVX2 (flags in CMakeLists.txt; run only where torchmha's AVX2 or AVX-512 copy runs).
//
// Why: without VNNI, the float loop converts every 8 int8 weights with a sign-extend and a convert
// beside the FMA, and one row of x was bound by those instructions, not by reading (AMD EPYC Zen 3:
// 0.52-0.69 of a sum over the same bytes). vpmaddwd multiplies 16 sign-extended weights by 16
// 16-bit digits and adds the pairs in one instruction: two digits make 5 instructions per 16
// weights where the float loop takes 6. x is scaled by a power of two to integers of at most 2^29
// (exact but for rounding below 2^-30 of the row's largest |x|, far under float32's own error),
// split into a signed high and an unsigned low 15-bit digit; each digit's dot product is exact in
// int32 over a span of 4096 columns, and the spans and the two digits are combined in int64.
//
// Plain intrinsics only (nothing inline of ATen's or c10's), as in linear_kernel_vnni.cpp.

#include "linear_kernel.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace torchmha::cpu::kernel::avx2_int16 {
namespace {

// Prefetched this far ahead of the weights being read: 16 rows at K = 512. Measured on the AMD EPYC
// Zen 3 (36 step matrices, 2 threads, in one process): 4 rows ahead (the float loop's distance,
// 2 KiB of int8) read 25.8 GB/s, 16 rows 27.5.
constexpr int64_t kPrefetchBytes = 8192;

// The largest |x| of a row, or a negative value if the row holds an inf or a NaN.
float row_magnitude(const float* row, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 infinity = _mm256_set1_ps(INFINITY);
  __m256 largest = _mm256_setzero_ps();
  __m256 not_finite = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 magnitude = _mm256_andnot_ps(sign, _mm256_loadu_ps(row + k));
    // (NaN compares unordered, inf equal to inf: both fail "less than inf")
    not_finite = _mm256_or_ps(not_finite, _mm256_cmp_ps(magnitude, infinity, _CMP_NLT_UQ));
    largest = _mm256_max_ps(largest, magnitude);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  float result = 0.0f;
  for (float lane : lanes) result = lane > result ? lane : result;
  bool finite = _mm256_movemask_ps(not_finite) == 0;
  for (; k < K; ++k) {
    const float magnitude = std::fabs(row[k]);
    finite = finite && std::isfinite(magnitude);
    result = magnitude > result ? magnitude : result;
  }
  return finite ? result : -1.0f;
}

// u = round(x * factor) as the high digit u >> 15 and the low u & 0x7FFF, for 16 columns.
void split(const float* row, __m256 factor, int16_t* high, int16_t* low) {
  const __m256i u0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row), factor));
  const __m256i u1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + 8), factor));
  const __m256i mask = _mm256_set1_epi32(0x7FFF);
  // (packs works within 128-bit lanes: the permute puts the 16 values back in order)
  const auto pack = [](__m256i a, __m256i b) { return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(high), pack(_mm256_srai_epi32(u0, 15), _mm256_srai_epi32(u1, 15)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(low), pack(_mm256_and_si256(u0, mask), _mm256_and_si256(u1, mask)));
}

// Each int32 lane gains less than 2^23 a block of 16 columns (|w| <= 128, digits below 2^15, two
// products a lane), so a span of this many columns sums in int32 over all of its accumulators:
// 256 blocks, under 2^31. Longer rows are taken a span at a time, each span's sums widened.
constexpr int64_t kInt32Span = 4096;

// The int32 lanes of v, widened and summed in int64 lanes.
inline __m256i widened(__m256i v) {
  return _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                          _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
}

// The sum of the int32 lanes of high * 2^15 + low over U accumulators each (one span's), in int64.
template <int U>
int64_t combine(const __m256i* high, const __m256i* low) {
  __m256i h = high[0], l = low[0];
  for (int u = 1; u < U; ++u) {
    h = _mm256_add_epi32(h, high[u]);
    l = _mm256_add_epi32(l, low[u]);
  }
  const __m256i total = _mm256_add_epi64(_mm256_slli_epi64(widened(h), 15), widened(l));
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// 16 columns from k: the weights sign-extended to 16 bits, against each digit.
inline void block(const int8_t* w, __m256i high, __m256i low, int64_t k, __m256i& high_sum, __m256i& low_sum) {
  const __m256i weights = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
  high_sum = _mm256_add_epi32(high_sum, _mm256_madd_epi16(weights, high));
  low_sum = _mm256_add_epi32(low_sum, _mm256_madd_epi16(weights, low));
}

inline __m256i load(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Features [o, o + F): their dot products with x's digits, F rows of weights at once, U blocks of
// 16 columns a step (F U = 4: 8 independent vpmaddwd chains). Four features a pass load each
// block of x's digits once for four rows of weights (6.5 instructions per 16 weights, against 8
// one feature a pass), and four adjacent rows are one contiguous block, which the prefetchers
// still follow. AMD EPYC Zen 3, weight_reads' 36 int8 matrices at one row, 2 threads, alternated
// in one process against one feature a pass (medians of 12 rounds, 3 runs): 1.11-1.17x faster; the
// generation model's int8 step 1.12 -> 1.00 ms.
// Columns [k0, k1) of features [o, o + F), rows `w` on (k1 - k0 a multiple of 16, at most
// kInt32Span), added to dots.
template <int F, int U>
void span_sums(const Int16Problem& p, const int8_t* w, int64_t k0, int64_t k1, int64_t* dots) {
  const int16_t* high = p.x.digits;
  const int16_t* low = p.x.digits + p.x.padded_k;
  // (an address, not a pointer into the weights: it may lie past their end)
  const char* ahead = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w) + kPrefetchBytes);
  __m256i high_sums[F][U], low_sums[F][U];
  for (int i = 0; i < F * U; ++i) high_sums[i / U][i % U] = low_sums[i / U][i % U] = _mm256_setzero_si256();
  // (prefetch_offset's block wherever rows lie one after another: `features` takes every span of K
  // for the same F rows in turn. AMD EPYC Zen 3, the step's 36 int8 matrices, one thread, against a
  // sum of the same bytes, medians of 60 alternated rounds: 0.89 of the sum's rate, against 0.63
  // in each row's order)
  const bool one_block = p.w_stride == p.K;
  int64_t k = k0;
  for (; k + 16 * U <= k1; k += 16 * U) {
    if (k % 64 == 0) {
      for (int f = 0; f < F; ++f) {
        _mm_prefetch(ahead + prefetch_offset(one_block, F, f, k, 64, p.w_stride), _MM_HINT_T0);
      }
    }
    for (int u = 0; u < U; ++u) {
      const __m256i x_high = load(high + k + 16 * u), x_low = load(low + k + 16 * u);
      for (int f = 0; f < F; ++f) {
        block(w + f * p.w_stride, x_high, x_low, k + 16 * u, high_sums[f][u], low_sums[f][u]);
      }
    }
  }
  for (; k < k1; k += 16) {
    const __m256i x_high = load(high + k), x_low = load(low + k);
    for (int f = 0; f < F; ++f) block(w + f * p.w_stride, x_high, x_low, k, high_sums[f][0], low_sums[f][0]);
  }
  for (int f = 0; f < F; ++f) dots[f] += combine<U>(high_sums[f], low_sums[f]);
}

// Features [o, o + F) (span_sums' F and U), a span of columns at a time, then the columns past the
// last whole block of 16; each feature's sum scaled to y.
template <int F, int U>
void features(const Int16Problem& p, int64_t o) {
  const int8_t* w = p.w + o * p.w_stride;
  const int16_t* high = p.x.digits;
  const int16_t* low = p.x.digits + p.x.padded_k;
  int64_t dots[F] = {};
  const int64_t whole = p.K / 16 * 16;
  for (int64_t k = 0; k < whole; k += kInt32Span) span_sums<F, U>(p, w, k, std::min(whole, k + kInt32Span), dots);
  for (int64_t k = whole; k < p.K; ++k) {
    for (int f = 0; f < F; ++f) dots[f] += int64_t(w[f * p.w_stride + k]) * (int64_t(high[k]) * 32768 + low[k]);
  }
  for (int f = 0; f < F; ++f) {
    const double y = static_cast<double>(dots[f]) * p.x.step * static_cast<double>(p.scale[o + f]);
    p.y[o + f] = static_cast<float>(p.bias != nullptr ? y + p.bias[o + f] : y);
  }
}

}  // namespace

bool int16_row(const float* x, int64_t K, Int16Rows& out) {
  const float largest = row_magnitude(x, K);
  if (largest < 0) {
    return false;
  }
  int exponent = 0;
  std::frexp(largest, &exponent);  // largest < 2^exponent (and 0 for a row of zeros)
  const int shift = exponent - 29;
  if (shift < -126) {  // (2^-shift a float: a row whose largest |x| is below 2^-98 takes the float loop)
    return false;
  }
  out.step = std::ldexp(1.0, shift);
  const __m256 factor = _mm256_set1_ps(std::ldexp(1.0f, -shift));
  int16_t* high = out.digits;
  int16_t* low = out.digits + out.padded_k;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) split(x + k, factor, high + k, low + k);
  if (k < K) {  // the last columns through a zero-padded copy
    alignas(32) float tail[16] = {};
    for (int64_t j = k; j < K; ++j) tail[j - k] = x[j];
    split(tail, factor, high + k, low + k);
  }
  return true;
}

void quantized_row(const Int16Problem& p, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + 4 <= end; o += 4) features<4, 1>(p, o);
  for (; o < end; ++o) features<1, 4>(p, o);
}

}  // namespace torchmha::cpu::kernel::avx2_int16
