#pragma once

// The decode kernel's inner loop (decode_kernel.h), for one instruction set: included only by
// decode_kernel_avx2.cpp and decode_kernel_avx512.cpp, which define TORCHMHA_KERNEL_ISA and are
// compiled with that set's flags (and at::vec's matching CPU_CAPABILITY, so the two copies share
// no symbol).

#include "decode_kernel.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

namespace torchmha::core::kernel::TORCHMHA_KERNEL_ISA {
namespace {

template <typename scalar_t>
using Vec = at::vec::Vectorized<scalar_t>;

// Scores of one query row against `keys` keys, four keys at a time (four FMA chains, then one
// horizontal sum each). C > 0: rows of exactly C vectors, unrolled so the query stays in
// registers; C == 0: any D.
template <typename scalar_t, int C>
void score_keys(const scalar_t* query, const scalar_t* k, int64_t keys, int64_t D, scalar_t* scores) {
  using V = Vec<scalar_t>;
  constexpr int64_t S = V::size();
  const int64_t chunks = C > 0 ? C : D / S;
  const auto sum = [](V a, V b) { return a + b; };
  int64_t j = 0;
  if (C > 0 || D % S == 0) {
    V q[C > 0 ? C : 1];
    if constexpr (C > 0) {
      for (int c = 0; c < C; ++c) q[c] = V::loadu(query + c * S);
    }
    for (; j + 4 <= keys; j += 4) {
      V acc[4] = {V(0), V(0), V(0), V(0)};
      for (int64_t c = 0; c < chunks; ++c) {
        const V x = C > 0 ? q[C > 0 ? c : 0] : V::loadu(query + c * S);
        for (int r = 0; r < 4; ++r) {
          acc[r] = at::vec::fmadd(x, V::loadu(k + (j + r) * D + c * S), acc[r]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        scores[j + r] = at::vec::vec_reduce_all<scalar_t>(sum, acc[r]);
      }
    }
  }
  for (; j < keys; ++j) {
    scores[j] = at::vec::map2_reduce_all<scalar_t>([](V a, V b) { return a * b; }, sum, query, k + j * D, D);
  }
}

// result = scale * sum_j weights[j] * v[j]: with rows of C vectors the accumulators stay in
// registers across all keys (C == 0: any D, accumulated in `result`, zeroed first).
template <typename scalar_t, int C>
void weigh_values(const scalar_t* weights, const scalar_t* v, int64_t keys, int64_t D, scalar_t scale,
                  scalar_t* result) {
  using V = Vec<scalar_t>;
  constexpr int64_t S = V::size();
  if constexpr (C > 0) {
    V acc[C];
    for (int c = 0; c < C; ++c) acc[c] = V(0);
    for (int64_t j = 0; j < keys; ++j) {
      const V w(weights[j]);
      for (int c = 0; c < C; ++c) {
        acc[c] = at::vec::fmadd(w, V::loadu(v + j * D + c * S), acc[c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      (acc[c] * V(scale)).store(result + c * S);
    }
  } else {
    std::fill(result, result + D, scalar_t(0));
    for (int64_t j = 0; j < keys; ++j) {
      const V w(weights[j] * scale);
      at::vec::map2([w](V acc, V x) { return at::vec::fmadd(w, x, acc); }, result, result, v + j * D, D);
    }
  }
}

// Query row `query` over keys [0, keys): scores, softmax, weighted sum of the values into `result`.
template <typename scalar_t, int C>
void attend_row(const DecodeProblem<scalar_t>& p, const scalar_t* query, const scalar_t* k, const scalar_t* v,
                const scalar_t* pad, int64_t keys, scalar_t* result, std::vector<scalar_t>& scores) {
  using V = Vec<scalar_t>;
  scores.resize(keys);
  score_keys<scalar_t, C>(query, k, keys, p.D, scores.data());
  const int64_t padded = pad != nullptr ? std::min(keys, p.padding_len) : 0;
  at::vec::map([scale = p.scale](V x) { return x * V(scale); }, scores.data(), scores.data(), keys);
  if (padded > 0) {
    at::vec::map2([](V x, V bias) { return x + bias; }, scores.data(), scores.data(), pad, padded);
  }
  const scalar_t max = at::vec::reduce_all<scalar_t>([](V a, V b) { return at::vec::maximum(a, b); }, scores.data(), keys);
  at::vec::map([max](V x) { return (x - V(max)).exp_u20(); }, scores.data(), scores.data(), keys);
  const scalar_t sum = at::vec::reduce_all<scalar_t>([](V a, V b) { return a + b; }, scores.data(), keys);
  weigh_values<scalar_t, C>(scores.data(), v, keys, p.D, scalar_t(1) / sum, result);
}

// The unrolled variant for the common head sizes (D = 2, 4, 8 or 16 vectors), else the general one.
template <typename scalar_t>
void attend_row(const DecodeProblem<scalar_t>& p, const scalar_t* query, const scalar_t* k, const scalar_t* v,
                const scalar_t* pad, int64_t keys, scalar_t* result, std::vector<scalar_t>& scores) {
  const int64_t S = Vec<scalar_t>::size();
  switch (p.D % S == 0 ? p.D / S : 0) {
    case 2: return attend_row<scalar_t, 2>(p, query, k, v, pad, keys, result, scores);
    case 4: return attend_row<scalar_t, 4>(p, query, k, v, pad, keys, result, scores);
    case 8: return attend_row<scalar_t, 8>(p, query, k, v, pad, keys, result, scores);
    case 16: return attend_row<scalar_t, 16>(p, query, k, v, pad, keys, result, scores);
    default: return attend_row<scalar_t, 0>(p, query, k, v, pad, keys, result, scores);
  }
}

template <typename scalar_t>
void run(const DecodeProblem<scalar_t>& p, int64_t begin, int64_t end) {
  std::vector<scalar_t> scores;
  const int64_t D = p.D;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t n = i / p.H, h = i % p.H;
    const int64_t start = p.before[n], count = p.added[n];
    scalar_t* k = p.k_cache + i * p.M * D;
    scalar_t* v = p.v_cache + i * p.M * D;
    const scalar_t* k_new = p.k_new + n * p.new_strides[0] + h * p.new_strides[1];
    const scalar_t* v_new = p.v_new + n * p.new_strides[0] + h * p.new_strides[1];
    for (int64_t t = 0; t < count; ++t) {
      std::copy(k_new + t * p.new_strides[2], k_new + t * p.new_strides[2] + D, k + (start + t) * D);
      std::copy(v_new + t * p.new_strides[2], v_new + t * p.new_strides[2] + D, v + (start + t) * D);
    }
    const scalar_t* q = p.q + n * p.q_strides[0] + h * p.q_strides[1];
    const scalar_t* pad = p.padding != nullptr ? p.padding + n * p.padding_stride : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      attend_row(p, q + t * p.q_strides[2], k, v, pad, start + t + 1, p.out + (i * p.T + t) * D, scores);
    }
    std::fill(p.out + (i * p.T + count) * D, p.out + (i + 1) * p.T * D, scalar_t(0));
  }
}

}  // namespace

void decode_heads(const DecodeProblem<float>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void decode_heads(const DecodeProblem<double>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

}  // namespace torchmha::core::kernel::TORCHMHA_KERNEL_ISA
