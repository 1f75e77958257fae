#pragma once

// The small-batch linear kernel's inner loop (linear_kernel.h), for one instruction set: included
// only by linear_kernel_avx2.cpp and linear_kernel_avx512.cpp, which define TORCHMHA_KERNEL_ISA.

#include "linear_kernel.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA {
namespace {

using V = at::vec::Vectorized<float>;

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

// Accumulators a feature may hold in registers: half of them (8 of AVX2's 16, 16 of AVX-512's 32).
constexpr int kAccumulators = V::size() == 16 ? 16 : 8;

// Output feature `o` for all M rows: its weight row is read once, front to back, and each vector
// of it used M times. U vectors of the row at a time, each with its own accumulators, so that the
// FMA chains do not wait on each other and many loads are in flight (one row: U = 16 on AVX-512,
// 26-31 GB/s over a decoding step's 88 MB of float32 weights on AMD EPYC, against 24 with U = 8).
// One row after another makes the weights a single sequential stream, which the prefetchers
// follow; interleaving rows (several features at once) measured half the rate (10.7 against 20
// GB/s on one core). A software prefetch 1 KiB ahead measured no better.
template <typename scalar_t, typename weight_t, int M>
void feature(const LinearProblem<scalar_t, weight_t>& p, int64_t o) {
  constexpr int U = kAccumulators / M >= 16 ? 16 : kAccumulators / M >= 8 ? 8 : kAccumulators / M >= 4 ? 4 : kAccumulators / M >= 2 ? 2 : 1;
  constexpr int64_t S = V::size();
  const weight_t* w = p.w + o * p.w_stride;
  V acc[M][U];
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < U; ++u) acc[m][u] = V(0);
  }
  int64_t k = 0;
  for (; k + U * S <= p.K; k += U * S) {
    for (int u = 0; u < U; ++u) {
      const V weights = load_float(w + k + u * S);
      for (int m = 0; m < M; ++m) acc[m][u] = at::vec::fmadd(weights, V::loadu(p.x + m * p.K + k + u * S), acc[m][u]);
    }
  }
  for (; k + S <= p.K; k += S) {
    const V weights = load_float(w + k);
    for (int m = 0; m < M; ++m) acc[m][0] = at::vec::fmadd(weights, V::loadu(p.x + m * p.K + k), acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    V total = acc[m][0];
    for (int u = 1; u < U; ++u) total = total + acc[m][u];
    float sum = at::vec::vec_reduce_all<float>([](V a, V b) { return a + b; }, total);
    for (int64_t j = k; j < p.K; ++j) {
      sum += float(w[j]) * p.x[m * p.K + j];
    }
    if constexpr (std::is_same_v<weight_t, int8_t>) {
      sum *= p.scale[o];
    }
    if (p.bias != nullptr) {
      sum += float(p.bias[o]);
    }
    p.y[m * p.O + o] = scalar_t(sum);
  }
}

template <typename scalar_t, typename weight_t, int M>
void rows_of(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) feature<scalar_t, weight_t, M>(p, o);
}

template <typename scalar_t, typename weight_t>
void run(const LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end) {
  switch (p.M) {
    case 1: return rows_of<scalar_t, weight_t, 1>(p, begin, end);
    case 2: return rows_of<scalar_t, weight_t, 2>(p, begin, end);
    case 3: return rows_of<scalar_t, weight_t, 3>(p, begin, end);
    case 4: return rows_of<scalar_t, weight_t, 4>(p, begin, end);
    case 5: return rows_of<scalar_t, weight_t, 5>(p, begin, end);
    case 6: return rows_of<scalar_t, weight_t, 6>(p, begin, end);
    case 7: return rows_of<scalar_t, weight_t, 7>(p, begin, end);
    default: return rows_of<scalar_t, weight_t, 8>(p, begin, end);
  }
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

}  // namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA
