// bfloat16 x against bfloat16 or int8 weights (linear_kernel.h, "BFloat16Problem"), built for
// AVX512-BF16 (flags in CMakeLists.txt; run only where the CPU has avx512_bf16:
// small_linear_kernel.cpp). int8 weights are converted to bfloat16 exactly, once for all rows.
//
// Why: the float loop widens each 16 bfloat16 weights (a zero-extend and a shift) beside each FMA
// and reads x widened to float; one row was bound by those instructions, not by reading.
// vdpbf16ps takes 32 weights an instruction as they are. Its products of two bfloat16 values are exact in float and
// summed in float, as torch's bfloat16 linear does (it differs only in treating subnormal inputs,
// below 1.2e-38, as zero).
//
// Plain intrinsics only (nothing inline of ATen's or c10's): this file is built with flags the
// baseline CPU may lack, and an inline function emitted here could be picked by the linker for
// code that runs everywhere.

#include "linear_kernel.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace torchmha::cpu::kernel::avx512_bf16 {
namespace {

constexpr int64_t S = 32;  // bfloat16 values a vector

// (the float loop's distance: linear_kernel_impl.h)
constexpr int64_t kPrefetchRows = 4;

// float to bfloat16, rounded to nearest even, NaN to a quiet NaN: c10::BFloat16's conversion.
uint16_t to_bfloat16(float value) {
  if (value != value) {
    return 0x7FC0;
  }
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

float to_float(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out = 0;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// (a vector bitcast: 32 bfloat16 values as vdpbf16ps's operand type)
__m512bh as_pairs(__m512i v) {
  return (__m512bh)v;
}

// 32 weights from w as bfloat16 (whole: all 32, else the lanes set): bfloat16 as they are; int8
// sign-extended, converted to float and packed to bfloat16, exactly (|w| <= 128 has 8 bits).
template <typename weight_t>
__m512i load_weights(const weight_t* w, __mmask32 lanes, bool whole) {
  if constexpr (std::is_same_v<weight_t, uint16_t>) {
    return whole ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi16(lanes, w);
  } else {
    const __m128i low = whole ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w))
                              : _mm_maskz_loadu_epi8(static_cast<__mmask16>(lanes), w);
    const __m128i high = whole ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))
                               : _mm_maskz_loadu_epi8(static_cast<__mmask16>(lanes >> 16), w + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low)));
  }
}

// Output features [o, o + F) for all M rows, as the float loop's `features` (linear_kernel_impl.h):
// each weight row read once, front to back, U vectors at a time with their own accumulators.
// F = 2 loads each vector of x once for both features: small_linear_kernel.cpp's
// bfloat16_features_a_pass says where (int8 weights from 6 rows on Zen 4). Two rows of bfloat16
// weights streamed at once read slower (Zen 4: 1.11-1.46x the time at 3-8 rows over weight_reads'
// 36 matrices; Zen 5, an earlier two-a-pass loop: 1.25-1.29 against 1.12-1.13 ms at 3-4 rows, equal
// at 8), so they keep one a pass.
template <typename weight_t, int M, int F>
void features(const BFloat16Problem<weight_t>& p, int64_t o) {
  constexpr int A = 16 / (M * F);
  constexpr int U = A >= 8 ? 8 : A >= 4 ? 4 : A >= 2 ? 2 : 1;
  const weight_t* w = p.w + o * p.w_stride;
  // (an address, not a pointer into the weights: it may lie past their end)
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w) + kPrefetchRows * p.w_stride * sizeof(weight_t);
  const bool one_block = p.prefetch_in_order && F > 1 && p.w_stride == p.K;  // (prefetch_offset's block)
  __m512 acc[F][M][U];
  for (int f = 0; f < F; ++f) {
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < U; ++u) acc[f][m][u] = _mm512_setzero_ps();
    }
  }
  // (whole: K - k >= S, else the first K - k lanes)
  const auto block = [&](int64_t k, int u, bool whole) {
    const __mmask32 lanes = whole ? ~__mmask32(0) : (__mmask32(1) << (p.K - k)) - 1;
    __m512i weights[F];
    for (int f = 0; f < F; ++f) {
      const int64_t offset = prefetch_offset(one_block, F, f, k, S, p.w_stride);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + offset * sizeof(weight_t)), _MM_HINT_T0);
      weights[f] = load_weights(w + f * p.w_stride + k, lanes, whole);
    }
    for (int m = 0; m < M; ++m) {
      const uint16_t* x = p.x + m * p.K + k;
      __m512i xs = whole ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi16(lanes, x);
      if constexpr (F > 1) {
        asm("" : "+v"(xs));  // (in a register: else GCC may fold the load into each feature's vdpbf16ps)
      }
      for (int f = 0; f < F; ++f) acc[f][m][u] = _mm512_dpbf16_ps(acc[f][m][u], as_pairs(weights[f]), as_pairs(xs));
    }
  };
  int64_t k = 0;
  for (; k + U * S <= p.K; k += U * S) {
    for (int u = 0; u < U; ++u) block(k + u * S, u, true);
  }
  for (; k + S <= p.K; k += S) block(k, 0, true);
  if (k < p.K) {
    block(k, 0, false);
  }
  for (int f = 0; f < F; ++f) {
    for (int m = 0; m < M; ++m) {
      __m512 total = acc[f][m][0];
      for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[f][m][u]);
      float sum = _mm512_reduce_add_ps(total);
      if (p.scale != nullptr) {
        sum *= p.scale[o + f];
      }
      if (p.bias != nullptr) {
        sum += to_float(p.bias[o + f]);
      }
      p.y[m * p.O + o + f] = to_bfloat16(sum);
    }
  }
}

template <typename weight_t, int M>
void rows_of(const BFloat16Problem<weight_t>& p, int64_t begin, int64_t end) {
  int64_t o = begin;
  if (p.features_a_pass == 2) {
    for (; o + 2 <= end; o += 2) features<weight_t, M, 2>(p, o);
  }
  for (; o < end; ++o) features<weight_t, M, 1>(p, o);
}

template <typename weight_t>
void run(const BFloat16Problem<weight_t>& p, int64_t begin, int64_t end) {
  switch (p.M) {
    case 1: return rows_of<weight_t, 1>(p, begin, end);
    case 2: return rows_of<weight_t, 2>(p, begin, end);
    case 3: return rows_of<weight_t, 3>(p, begin, end);
    case 4: return rows_of<weight_t, 4>(p, begin, end);
    case 5: return rows_of<weight_t, 5>(p, begin, end);
    case 6: return rows_of<weight_t, 6>(p, begin, end);
    case 7: return rows_of<weight_t, 7>(p, begin, end);
    default: return rows_of<weight_t, 8>(p, begin, end);
  }
}

}  // namespace

void bfloat16_rows(const BFloat16Problem<uint16_t>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void bfloat16_rows(const BFloat16Problem<int8_t>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

}  // namespace torchmha::cpu::kernel::avx512_bf16
