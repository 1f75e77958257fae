#pragma once

// The sums of many vectors' lanes at once, for the kernels' last step (one sum per output): plain
// AVX-512F intrinsics, for files built with AVX-512 flags only (internal linkage: no copy of this is
// shared with code built for the baseline CPU).

#include <immintrin.h>

namespace torchmha::cpu::kernel {
namespace {

// out[i] = the sum of v[i]'s 16 lanes, for i < N <= 16: one tree of 15 shuffle-and-add steps over
// 16 vectors (zeros past N) that leaves vector i's sum in lane i, where N separate reductions take 4
// steps each (8 rows of float32 weights: those were 22% of a call on 2048x512 weights, AMD Zen 5).
// Each step halves the lanes a vector's partial sum spans and doubles the vectors a register holds;
// input slot 4i + j takes vector 4j + i, so that the last step's lanes come out in order.
template <int N>
inline void lane_sums(const __m512* v, float* out) {
  static_assert(N >= 1 && N <= 16);
  const auto slot = [&](int s) {
    const int index = 4 * (s % 4) + s / 4;
    return index < N ? v[index] : _mm512_setzero_ps();
  };
  const auto halves = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  };
  const auto quarters = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  };
  const auto pairs = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  };
  const auto singles = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  };
  __m512 h[8], q[4], p[2];
  for (int i = 0; i < 8; ++i) h[i] = halves(slot(2 * i), slot(2 * i + 1));
  for (int i = 0; i < 4; ++i) q[i] = quarters(h[2 * i], h[2 * i + 1]);
  for (int i = 0; i < 2; ++i) p[i] = pairs(q[2 * i], q[2 * i + 1]);
  alignas(64) float all[16];
  _mm512_store_ps(all, singles(p[0], p[1]));
  for (int i = 0; i < N; ++i) out[i] = all[i];
}

}  // namespace
}  // namespace torchmha::cpu::kernel
