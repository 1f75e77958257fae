// int8 weights against x held as exact integers (linear_kernel.h, "IntegerRows"), built for
// AVX512-VNNI (flags in CMakeLists.txt; run only where at::cpu::is_avx512_vnni_supported()).
//
// Why: converting int8 weights to float costs a sign-extend and a convert per 16 weights beside
// the FMA, and one row of x was bound by that, not by reading (AMD EPYC Zen 5: 73 GB/s on
// cache-resident weights). vpdpbusd takes 64 weights an instruction as they are. x is scaled by a
// power of two to integers below 2^30 (exact but for rounding below 2^-31 of the row's largest
// |x|, far under float32's own error) and split into four signed base-256 digits; each digit's
// dot product with the weights is exact in int32, and the four are combined in int64.
//
// Plain intrinsics only (nothing inline of ATen's or c10's): this file is built with flags the
// baseline CPU may lack, and an inline function emitted here could be picked by the linker for
// code that runs everywhere.

#include "linear_kernel.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace torchmha::cpu::kernel::avx512_vnni {
namespace {

constexpr int kUnroll = 2;  // k-blocks of 64 in flight for one row: 8 independent vpdpbusd chains

__mmask16 lanes_before(int64_t k, int64_t K) {
  const int64_t left = K - k;
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// The largest |x| of a row, or a negative value if the row holds an inf or a NaN.
float row_magnitude(const float* row, int64_t K) {
  __m512 largest = _mm512_setzero_ps();
  __mmask16 not_finite = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(lanes_before(k, K), row + k);
    not_finite |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN | +inf | -inf | SNaN
    largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
  }
  return not_finite != 0 ? -1.0f : _mm512_reduce_max_ps(largest);
}

// One row of x as kDigits digit rows (the row's integers u = round(x / 2^shift), |u| < 2^30, as
// u = sum_l d_l 256^l with d_l in [-128, 127]); returns sum_k u_k.
int64_t row_digits(const float* row, int64_t K, int64_t padded_k, int shift, int8_t* digits) {
  const __m512 down = _mm512_set1_ps(static_cast<float>(-shift));
  __m512i digit_sums[kDigits];
  for (auto& sum : digit_sums) sum = _mm512_setzero_si512();
  for (int64_t k = 0; k < padded_k; k += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(k < K ? lanes_before(k, K) : __mmask16(0), row + k);
    __m512i u = _mm512_cvtps_epi32(_mm512_scalef_ps(v, down));  // exact scaling, rounded to nearest
    for (int l = 0; l < kDigits; ++l) {
      const __m512i d = _mm512_srai_epi32(_mm512_slli_epi32(u, 24), 24);  // the low byte, signed
      _mm_storeu_si128(reinterpret_cast<__m128i*>(digits + l * padded_k + k), _mm512_cvtepi32_epi8(d));
      digit_sums[l] = _mm512_add_epi32(digit_sums[l], d);
      u = _mm512_srai_epi32(_mm512_sub_epi32(u, d), 8);
    }
  }
  int64_t total = 0;
  for (int l = 0; l < kDigits; ++l) {
    total += static_cast<int64_t>(_mm512_reduce_add_epi32(digit_sums[l])) << (8 * l);
  }
  return total;
}

// sum_l 256^l (sum of acc[l]'s lanes), exactly, in int64.
int64_t combine(const __m512i* acc) {
  __m512i total = _mm512_setzero_si512();
  for (int l = 0; l < kDigits; ++l) {
    const __m512i low = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[l]));
    const __m512i high = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[l], 1));
    total = _mm512_add_epi64(total, _mm512_slli_epi64(_mm512_add_epi64(low, high), 8 * l));
  }
  return _mm512_reduce_add_epi64(total);
}

// combine's sum, where each digit's whole dot product fits int32 (|sum_k (w_k + 128) d_k| <= 255 *
// 128 * K < 2^31 for K <= 2^16): the four digits' lanes summed at once, a transposing tree of int32
// shuffles and adds, then combined as scalars, where combine widens all 64 lanes to int64 first.
int64_t combine_short(const __m512i* acc) {
  const auto halves = [](__m512i a, __m512i b) {  // 128-bit lanes 0-1: a's halves summed, 2-3: b's
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
  };
  const __m512i ab = halves(acc[0], acc[1]), cd = halves(acc[2], acc[3]);
  // 128-bit lane l: digit l's four partial sums
  __m512i sums = _mm512_add_epi32(_mm512_shuffle_i32x4(ab, cd, 0x88), _mm512_shuffle_i32x4(ab, cd, 0xDD));
  sums = _mm512_add_epi32(sums, _mm512_shuffle_epi32(sums, _MM_PERM_BADC));
  sums = _mm512_add_epi32(sums, _mm512_shuffle_epi32(sums, _MM_PERM_CDAB));
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, sums);
  return int64_t(lanes[0]) + (int64_t(lanes[4]) << 8) + (int64_t(lanes[8]) << 16) + (int64_t(lanes[12]) << 24);
}

// Output features [begin, end) for M rows. The weights are read as unsigned w + 128 (vpdpbusd's
// first operand), against the signed digits; 128 sum_k u_k is taken off at the end.
template <int M>
void features(const IntegerProblem& p, int64_t begin, int64_t end) {
  constexpr int U = M == 1 ? kUnroll : 1;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t K = p.K, padded = p.x.padded_k;
  // (one row only: 2-3 rows measured 0.90-1.05x; at 4 GCC then kept accumulators on the stack)
  const bool short_rows = M == 1 && padded <= (int64_t(1) << 16);
  const __mmask64 tail = (K % 64) == 0 ? ~__mmask64(0) : (__mmask64(1) << (K % 64)) - 1;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* w = p.w + o * p.w_stride;
    __m512i acc[M][U][kDigits];
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < U; ++u) {
        for (int l = 0; l < kDigits; ++l) acc[m][u][l] = _mm512_setzero_si512();
      }
    }
    int64_t k = 0;
    for (; k + 64 * U <= K; k += 64 * U) {
      for (int u = 0; u < U; ++u) {
        const __m512i weights = _mm512_xor_si512(_mm512_loadu_si512(w + k + 64 * u), flip);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = p.x.digits + m * kDigits * padded + k + 64 * u;
          for (int l = 0; l < kDigits; ++l) {
            acc[m][u][l] = _mm512_dpbusd_epi32(acc[m][u][l], weights, _mm512_loadu_si512(x + l * padded));
          }
        }
      }
    }
    for (; k < K; k += 64) {  // (the digits past K are zero: what the masked load reads there is unused)
      const __m512i weights = _mm512_xor_si512(_mm512_maskz_loadu_epi8(k + 64 <= K ? ~__mmask64(0) : tail, w + k), flip);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = p.x.digits + m * kDigits * padded + k;
        for (int l = 0; l < kDigits; ++l) {
          acc[m][0][l] = _mm512_dpbusd_epi32(acc[m][0][l], weights, _mm512_loadu_si512(x + l * padded));
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int u = 1; u < U; ++u) {
        for (int l = 0; l < kDigits; ++l) acc[m][0][l] = _mm512_add_epi32(acc[m][0][l], acc[m][u][l]);
      }
      const int64_t dot = (short_rows ? combine_short(acc[m][0]) : combine(acc[m][0])) - 128 * p.x.sums[m];
      const double y = static_cast<double>(dot) * p.x.steps[m] * static_cast<double>(p.scale[o]);
      p.y[m * p.O + o] = static_cast<float>(p.bias != nullptr ? y + p.bias[o] : y);
    }
  }
}

}  // namespace

bool integer_rows(const float* x, int64_t M, int64_t K, IntegerRows& out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    const float largest = row_magnitude(row, K);
    if (largest < 0) {
      return false;
    }
    int exponent = 0;
    std::frexp(largest, &exponent);  // largest < 2^exponent (and 0 for a row of zeros)
    const int shift = exponent - 30;
    out.steps[m] = std::ldexp(1.0, shift);
    out.sums[m] = row_digits(row, K, out.padded_k, shift, out.digits + m * kDigits * out.padded_k);
  }
  return true;
}

void quantized_rows(const IntegerProblem& p, int64_t begin, int64_t end) {
  switch (p.M) {
    case 1: return features<1>(p, begin, end);
    case 2: return features<2>(p, begin, end);
    case 3: return features<3>(p, begin, end);
    default: return features<4>(p, begin, end);
  }
}

}  // namespace torchmha::cpu::kernel::avx512_vnni
