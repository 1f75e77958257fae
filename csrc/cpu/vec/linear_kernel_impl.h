#pragma once

// The small-batch linear kernel's inner loop (linear_kernel.h), for one instruction set: included
// only by linear_kernel_avx2.cpp and linear_kernel_avx512.cpp, which define TORCHMHA_KERNEL_ISA.

#include "linear_kernel.h"
#ifdef CPU_CAPABILITY_AVX512
#include "lane_sums.h"
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Unroll.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA {
namespace {

using V = at::vec::Vectorized<float>;
// V's own register, for arrays: V's default constructor zeroes, and GCC kept those arrays' zeroing
// (rep stos on the stack, then loads back: 11% of an 8-row call on 2048x512 float32 weights).
#ifdef CPU_CAPABILITY_AVX512
using Register = __m512;
#else
using Register = __m256;
#endif

template <typename scalar_t>
inline V load_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return V::loadu(p);
  } else if constexpr (std::is_same_v<scalar_t, int8_t>) {
    // V::size() int8 weights, sign-extended and converted (the scale is applied once per sum)
#ifdef CPU_CAPABILITY_AVX512
    return V(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
    return V(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
  } else {
    V out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

// v, pinned to a register where it is computed: without this, GCC read each vector of weights again
// from memory for every row of x it multiplied (at 3 rows, 4 loads of weights where 2 do).
inline V in_register(V v) {
#if defined(__GNUC__)
  Register r = v;
  asm("" : "+v"(r));
  return r;
#else
  return v;
#endif
}

// The sums of N vectors' lanes into out[0, N): on AVX-512 from 8 vectors on, in one tree
// (lane_sums.h).
template <int N>
inline void reduce_each(const Register* v, float* out) {
#ifdef CPU_CAPABILITY_AVX512
  if constexpr (N >= 8) {
    return lane_sums<N>(v, out);
  }
#endif
  for (int i = 0; i < N; ++i) out[i] = at::vec::vec_reduce_all<float>([](V a, V b) { return a + b; }, V(v[i]));
}

// Accumulators a feature may hold in registers: half of them (8 of AVX2's 16, 16 of AVX-512's 32).
constexpr int kAccumulators = V::size() == 16 ? 16 : 8;

// The weights kPrefetchRows rows ahead, at the same position, are prefetched as each vector is
// read: past the prefetchers' own distance once a row's arithmetic is long (several rows of x).
// Measured with weight_reads' 36 matrices, 2 threads, AMD EPYC Zen 5, alternated in one process
// against none: float32 1.67x faster at 8 rows, 1.34x at 4, 1.14x at 2, 1.04x at 1; int8's float
// loop 1.51x at 8; bfloat16 1.32x at 8, 1.27x at 4, 1.15x at 1. 2 and 8 rows ahead measured about
// as 4 (8 a little slower at 8 rows). (Prefetching past the last row is harmless: no fault.)
// Into L1 (prefetcht0), or into L2 only (prefetcht1) where LinearProblem::weights_to_l2 says
// (small_linear_kernel.cpp: Zen 4's float32 and bfloat16 weights); the AVX2 copy L1 only (an L2
// hint there measured no clear difference on the AMD EPYC Zen 3: docs/kernel_rules.md).
// The hint is __builtin_prefetch's locality, a constant: 3 is prefetcht0, 2 prefetcht1.
constexpr int64_t kPrefetchRows = 4;
constexpr int kIntoL1 = 3, kIntoL2 = 2;

// Columns [begin, end) of K in one pass over a block of features. Where x's rows do not fit L1
// together, K is taken in spans (rows_of), and each feature's sums are carried between the passes.
struct KSpan {
  int64_t begin, end;
  float* carried;  // (M, kFeatureBlock) sums of the block's features, from `block`; null: K whole
  int64_t block;   // the block's first feature
};
constexpr int64_t kFeatureBlock = 256;

// Features [o, o + F)'s sums over K's vectors up to column k, sums[f * M + m], into y: with the
// columns past the last whole vector, the sums carried between K's spans, the scale and the bias.
// (each step a loop of its own, tested once: one loop testing each for every sum was 12% of an
// 8-row call on 512x512 weights)
template <typename scalar_t, typename weight_t, int M, int F>
C10_ALWAYS_INLINE void finish(const LinearProblem<scalar_t, weight_t>& p, int64_t o, const KSpan& span, int64_t k,
                              float* sums) {
  const weight_t* w = p.w + o * p.w_stride;
  for (int64_t j = k; j < span.end; ++j) {
    for (int i = 0; i < F * M; ++i) sums[i] += float(w[i / M * p.w_stride + j]) * p.x[i % M * p.K + j];
  }
  if (span.carried != nullptr) {
    for (int i = 0; i < F * M; ++i) {
      float& carried = span.carried[i % M * kFeatureBlock + o + i / M - span.block];
      sums[i] += span.begin == 0 ? 0.0f : carried;
      carried = sums[i];
    }
    if (span.end < p.K) {
      return;
    }
  }
  for (int f = 0; f < F; ++f) {
    scalar_t* y = p.y + o + f;
    if constexpr (std::is_same_v<weight_t, int8_t>) {
      for (int m = 0; m < M; ++m) sums[f * M + m] *= p.scale[o + f];
    }
    if (p.bias != nullptr) {
      const float bias = float(p.bias[o + f]);
      for (int m = 0; m < M; ++m) y[m * p.O] = scalar_t(sums[f * M + m] + bias);
    } else {
      for (int m = 0; m < M; ++m) y[m * p.O] = scalar_t(sums[f * M + m]);
    }
  }
}

// Output features [o, o + F) for all M rows: each weight row is read once, front to back, and each
// vector of it used M times. U vectors of the row at a time, each with its own accumulators, so that
// the FMA chains do not wait on each other and many loads are in flight (one row: U = 16 on
// AVX-512, 26-31 GB/s over a decoding step's 88 MB of float32 weights on AMD EPYC, against 24 with
// U = 8). With few rows, one feature after another (F = 1) makes the weights a single sequential
// stream, which the prefetchers follow; interleaving features there measured half the rate (10.7
// against 20 GB/s on one core). With many rows the loop is bound by arithmetic and by loading x
// again for each feature: F = 2 loads each vector of x once for two features (rows_of).
template <typename scalar_t, typename weight_t, int M, int F, int Hint>
void features(const LinearProblem<scalar_t, weight_t>& p, int64_t o, const KSpan& span) {
  constexpr int A = kAccumulators / (M * F);
  constexpr int U = A >= 16 ? 16 : A >= 8 ? 8 : A >= 4 ? 4 : A >= 2 ? 2 : 1;
  constexpr int64_t S = V::size();
  const weight_t* w = p.w + o * p.w_stride;
  // (an address, not a pointer into the weights: it may lie past their end)
  const char* ahead = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w) +
                                                    kPrefetchRows * p.w_stride * sizeof(weight_t));
  // (prefetch_offset's block where LinearProblem::prefetch_in_order says; K whole, since a span's
  // pass moves on to the next features before the rest of K)
  const bool one_block = p.prefetch_in_order && F > 1 && p.w_stride == p.K && span.begin == 0 && span.end == p.K;
  Register acc[F][M][U];
  c10::ForcedUnroll<F * M * U>{}([&](auto i) { acc[i / (M * U)][i / U % M][i % U] = V(0); });
  const auto block = [&](int64_t k, int u) {
    V weights[F];
    for (int f = 0; f < F; ++f) {
      __builtin_prefetch(ahead + prefetch_offset(one_block, F, f, k, S, p.w_stride) * sizeof(weight_t), 0, Hint);
      weights[f] = in_register(load_float(w + f * p.w_stride + k));
    }
    for (int m = 0; m < M; ++m) {
      // (in a register from 5 rows at several features a pass: GCC folded the load into each
      // feature's FMA, loading x F times; 0.86-0.89x the time in cache on Zen 4, slower over the
      // 36 matrices at 3-4 rows: docs/kernel_rules.md, the small linear's features a pass)
      const V x = F > 1 && M >= 5 ? in_register(V::loadu(p.x + m * p.K + k)) : V::loadu(p.x + m * p.K + k);
      for (int f = 0; f < F; ++f) acc[f][m][u] = at::vec::fmadd(weights[f], x, V(acc[f][m][u]));
    }
  };
  int64_t k = span.begin;
  // (each u a constant: as a loop over u, GCC left it rolled from 2-3 rows of x at one feature a
  // pass, and the accumulators indexed by u then lived on the stack, a store and a reload around
  // every FMA)
  for (; k + U * S <= span.end; k += U * S) {
    c10::ForcedUnroll<U>{}([&](auto u) { block(k + u * S, u); });
  }
  for (; k + S <= span.end; k += S) block(k, 0);
  Register totals[F * M];
  c10::ForcedUnroll<F * M>{}([&](auto i) {
    V total = acc[i / M][i % M][0];
    if constexpr (U > 1) {
      c10::ForcedUnroll<U - 1>{}([&](auto u) { total = total + V(acc[i / M][i % M][u + 1]); });
    }
    totals[i] = total;
  });
  float sums[F * M];
  reduce_each<F * M>(totals, sums);
  finish<scalar_t, weight_t, M, F>(p, o, span, k, sums);
}

// Features two at a time from 3 rows of x, for float32 and int8 weights on AVX-512. Measured with
// the 36 matrices of weight_reads, 2 threads, AMD EPYC Zen 5, against one at a time (in one
// process, alternated): float32 1.10x faster at 3 rows, 1.12x at 4, 1.36x at 5, 1.30x at 8; int8
// (this loop: 5-8 rows, or no VNNI) 1.37x at 5, 1.11x at 8. Not bfloat16/float16, whose conversion
// loads are the bound: 0.70-0.85x at 3-4 rows, 0.96-1.06x at 8; again with the unrolled loop's registers,
// float16 0.89-0.93x at 4-8 rows (1.11x at 3 alone), bfloat16 0.84x at 3, 0.91x at 8. Not the
// AVX2 copy (8 accumulators): float32 0.81x at 3 rows, 0.98x at 4 on that CPU.
//
// int8 weights at one row of x, on AVX-512: four features a pass. A row of int8 weights is a
// quarter of float32's bytes for the same sums and reductions, so one feature a pass was bound by
// its instructions on short rows (K = 512: 0.68-0.79 of a sum over the same bytes); four adjacent
// rows are one contiguous block, which the prefetchers still follow. Intel Xeon with AMX (2
// threads, each shape repeated to 16 MB, against a sum over its bytes as float32, alternated in
// one process): 512x512 0.90-0.96 of the sum against 0.77-0.79 one at a time, 1536x512 0.91-0.97
// against 0.75-0.76, 2048x512 0.92-0.96 against 0.68-0.77, 512x2048 0.91-0.94 against 0.85-0.87,
// 4096x4096 0.85-0.97 against 0.81-0.86; eight a pass 0.79-0.89. (AMD takes VNNI there.)
//
// The AVX2 copy at 5-8 rows of x: three features a pass, for rows 0-3 and then for the rest, while
// the three weight rows' span is in L1. With AVX2's 16 registers one feature at 8 rows has 8
// accumulators, one a row, each FMA waiting on the one before (8 in flight is all that keeps two
// FMA pipes busy), and 9 loads per 8 FMAs; three features at 4 rows have 12, and load x once for
// three. Measured with weight_reads' 36 matrices, 2 threads, AMD EPYC Zen 3 (AVX2), alternated in
// one process against one feature a pass (medians of 9-11 rounds, 3 runs): at 8 rows float32
// 1.05-1.09x faster, int8 1.10-1.12x, bfloat16 1.09-1.10x, float16 1.12-1.16x; at 5 rows float32
// 1.04-1.06x, int8 1.09x, bfloat16 1.05x, float16 1.16x. (A stand-alone copy of the two loops
// measured 1.20-1.26x in float32; the kernel's prefetches and reductions are shared by both.)
template <typename scalar_t, typename weight_t, int M, int Hint>
void row_halves(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end, const KSpan& span) {
  LinearProblem<scalar_t, weight_t> upper = p;  // rows 4 on
  upper.x += 4 * p.K;
  upper.y += 4 * p.O;
  upper.M = M - 4;
  const KSpan upper_span{span.begin, span.end, span.carried == nullptr ? nullptr : span.carried + 4 * kFeatureBlock,
                         span.block};
  int64_t o = begin;
  for (; o + 3 <= end; o += 3) {
    features<scalar_t, weight_t, 4, 3, Hint>(p, o, span);
    features<scalar_t, weight_t, M - 4, 3, Hint>(upper, o, upper_span);
  }
  for (; o < end; ++o) features<scalar_t, weight_t, M, 1, Hint>(p, o, span);
}

// The AVX2 copy at 2-4 rows: three features a pass too, 3-12 accumulators, where one
// feature at 4 rows loads x four times per weight vector, and converted weights (bfloat16, float16,
// int8) pay their conversion once for the three. AMD EPYC Zen 3, weight_reads' 36 matrices, 2
// threads, alternated processes (medians of 4-6 rounds, three runs), three a pass over one's
// time: at 4 rows float32 0.92-0.94, bfloat16 0.81-0.82, float16 0.79-0.85, int8 0.84-0.88; at 3
// rows bfloat16 0.90-1.05, float16 0.90-0.99, int8 0.89-0.91, but float32 1.04-1.07; at 2 rows
// int8 0.89-0.94, float32 1.04-1.07, bfloat16 1.09-1.14, float16 1.08-1.12. Two a pass (one run):
// 0.90-1.12 at 2-4 rows, no better than three.
//
// Output features a pass of features_in's loop (AVX-512 at every row count, AVX2 below 5 rows):
// on AVX-512 two from 3 rows for float32 and int8 weights, four at one row of int8; on AVX2 three
// as just said; else one.
template <typename weight_t, int M>
constexpr int features_a_pass() {
  constexpr bool is_float = std::is_same_v<weight_t, float>, is_int8 = std::is_same_v<weight_t, int8_t>;
  if constexpr (V::size() == 16) {
    return M >= 3 && (is_float || is_int8) ? 2 : M == 1 && is_int8 ? 4 : 1;
  } else {
    return M == 4 || (M == 3 && !is_float) || (M == 2 && is_int8) ? 3 : 1;
  }
}

// Features [begin, end), F at a time, then the rest one at a time.
template <typename scalar_t, typename weight_t, int M, int F, int Hint>
void features_by(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end, const KSpan& span) {
  int64_t o = begin;
  for (; o + F <= end; o += F) features<scalar_t, weight_t, M, F, Hint>(p, o, span);
  for (; o < end; ++o) features<scalar_t, weight_t, M, 1, Hint>(p, o, span);
}

// (float16 weights from 6 rows on AVX-512: two a pass where LinearProblem::half_pairs says, at run
// time: small_linear_kernel.cpp's half_pairs)
template <typename scalar_t, typename weight_t, int M, int Hint>
void features_in(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end, const KSpan& span) {
  if constexpr (V::size() == 8 && M >= 5) {
    row_halves<scalar_t, weight_t, M, Hint>(p, begin, end, span);
  } else if constexpr (V::size() == 16 && M >= 6 && std::is_same_v<weight_t, c10::Half>) {
    if (p.half_pairs) {
      return features_by<scalar_t, weight_t, M, 2, Hint>(p, begin, end, span);
    }
    features_by<scalar_t, weight_t, M, 1, Hint>(p, begin, end, span);
  } else {
    features_by<scalar_t, weight_t, M, features_a_pass<weight_t, M>(), Hint>(p, begin, end, span);
  }
}

// K's span for M rows: x's rows in float within 16 KB (of L1's 32-48), in whole blocks of 256
// columns, from 5 rows on; K whole where that is all of it. Why: every feature reads all of x, and
// rows past L1 came from L2 each time; 8 rows of K = 2048 (64 KB) ran at 158-162 GFLOP/s where
// K = 512 ran at 220-242 (AMD EPYC Zen 5). Over weight_reads' 36 matrices, 2 threads, alternated in
// one process against K whole: float32 1.13x faster at 5 rows, 1.06x at 8; float16 1.25x at 8;
// int8's float loop 1.07x at 5, 1.06x at 8; the AVX2 copy's float32 1.13x at 8. Spans of 1024 at
// 4 rows measured 0.98-1.03x: not taken.
template <int M>
int64_t k_span(int64_t K) {
  constexpr int64_t span = M >= 5 ? std::max<int64_t>(256, 4096 / M / 256 * 256) : 0;
  return span == 0 || K <= span ? K : span;
}

template <typename scalar_t, typename weight_t, int M, int Hint>
void rows_of(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end) {
  const int64_t span = k_span<M>(p.K);
  if (span == p.K) {
    return features_in<scalar_t, weight_t, M, Hint>(p, begin, end, KSpan{0, p.K, nullptr, begin});
  }
  float carried[M * kFeatureBlock];
  for (int64_t block = begin; block < end; block += kFeatureBlock) {
    const int64_t block_end = std::min(end, block + kFeatureBlock);
    for (int64_t k = 0; k < p.K; k += span) {
      const KSpan part{k, std::min(p.K, k + span), carried, block};
      features_in<scalar_t, weight_t, M, Hint>(p, block, block_end, part);
    }
  }
}

template <typename scalar_t, typename weight_t, int Hint>
void rows_with(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end) {
  switch (p.M) {
    case 1: return rows_of<scalar_t, weight_t, 1, Hint>(p, begin, end);
    case 2: return rows_of<scalar_t, weight_t, 2, Hint>(p, begin, end);
    case 3: return rows_of<scalar_t, weight_t, 3, Hint>(p, begin, end);
    case 4: return rows_of<scalar_t, weight_t, 4, Hint>(p, begin, end);
    case 5: return rows_of<scalar_t, weight_t, 5, Hint>(p, begin, end);
    case 6: return rows_of<scalar_t, weight_t, 6, Hint>(p, begin, end);
    case 7: return rows_of<scalar_t, weight_t, 7, Hint>(p, begin, end);
    default: return rows_of<scalar_t, weight_t, 8, Hint>(p, begin, end);
  }
}

template <typename scalar_t, typename weight_t>
void run(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end) {
#ifdef CPU_CAPABILITY_AVX512
  if (p.weights_to_l2) {
    return rows_with<scalar_t, weight_t, kIntoL2>(p, begin, end);
  }
#endif
  rows_with<scalar_t, weight_t, kIntoL1>(p, begin, end);
}

}  // namespace

void linear_rows(const LinearProblem<float>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void linear_rows(const LinearProblem<c10::BFloat16>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void linear_rows(const LinearProblem<c10::Half>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void linear_rows(const LinearProblem<float, int8_t>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void linear_rows(const LinearProblem<c10::BFloat16, int8_t>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void linear_rows(const LinearProblem<c10::Half, int8_t>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void to_float(const c10::BFloat16* x, int64_t n, float* out) {
  at::vec::convert(x, out, n);
}

void to_float(const c10::Half* x, int64_t n, float* out) {
  at::vec::convert(x, out, n);
}

}  // namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA
