#pragma once

// The decode kernel's inner loop (decode_kernel.h), for one instruction set: included only by
// decode_kernel_avx2.cpp and decode_kernel_avx512.cpp, which define TORCHMHA_KERNEL_ISA and are
// compiled with that set's flags (and at::vec's matching CPU_CAPABILITY, so the two copies share
// no symbol).

#include "decode_kernel.h"

#include <ATen/cpu/vec/functional.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA {
namespace {

template <typename scalar_t>
using Vec = at::vec::Vectorized<scalar_t>;

// The type a step computes in: float for bfloat16 and float16 storage (converted as it is read),
// else the storage type itself.
template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// One vector of acc_t read from storage.
template <typename scalar_t>
inline Vec<acc_t<scalar_t>> load_acc(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, acc_t<scalar_t>>) {
    return Vec<scalar_t>::loadu(p);
  } else {
    Vec<float> out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

// query . key over D, for any D: whole vectors, then the rest one by one.
template <typename scalar_t>
acc_t<scalar_t> dot(const acc_t<scalar_t>* query, const scalar_t* key, int64_t D) {
  using A = acc_t<scalar_t>;
  constexpr int64_t S = Vec<A>::size();
  Vec<A> acc(0);
  int64_t d = 0;
  for (; d + S <= D; d += S) {
    acc = at::vec::fmadd(Vec<A>::loadu(query + d), load_acc(key + d), acc);
  }
  A sum = at::vec::vec_reduce_all<A>([](Vec<A> a, Vec<A> b) { return a + b; }, acc);
  for (; d < D; ++d) {
    sum += query[d] * A(key[d]);
  }
  return sum;
}

// Scores of one query row against `keys` keys, four keys at a time (four FMA chains, then one
// horizontal sum each). C > 0: rows of exactly C vectors, unrolled so the query stays in
// registers; C == 0: any D.
template <typename scalar_t, int C>
void score_keys(const acc_t<scalar_t>* query, const scalar_t* k, int64_t keys, int64_t D, acc_t<scalar_t>* scores) {
  using A = acc_t<scalar_t>;
  using V = Vec<A>;
  constexpr int64_t S = V::size();
  const auto sum = [](V a, V b) { return a + b; };
  int64_t j = 0;
  if constexpr (C > 0) {
    V q[C];
    for (int c = 0; c < C; ++c) q[c] = V::loadu(query + c * S);
    for (; j + 4 <= keys; j += 4) {
      V acc[4] = {V(0), V(0), V(0), V(0)};
      for (int c = 0; c < C; ++c) {
        for (int r = 0; r < 4; ++r) {
          acc[r] = at::vec::fmadd(q[c], load_acc(k + (j + r) * D + c * S), acc[r]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        scores[j + r] = at::vec::vec_reduce_all<A>(sum, acc[r]);
      }
    }
  }
  for (; j < keys; ++j) {
    scores[j] = dot(query, k + j * D, D);
  }
}

// result = scale * sum_j weights[j] * v[j]: with rows of C vectors the accumulators stay in
// registers across all keys (C == 0: any D, accumulated in `result`, zeroed first).
template <typename scalar_t, int C>
void weigh_values(const acc_t<scalar_t>* weights, const scalar_t* v, int64_t keys, int64_t D, acc_t<scalar_t> scale,
                  acc_t<scalar_t>* result) {
  using A = acc_t<scalar_t>;
  using V = Vec<A>;
  constexpr int64_t S = V::size();
  if constexpr (C > 0) {
    V acc[C];
    for (int c = 0; c < C; ++c) acc[c] = V(0);
    for (int64_t j = 0; j < keys; ++j) {
      const V w(weights[j]);
      for (int c = 0; c < C; ++c) {
        acc[c] = at::vec::fmadd(w, load_acc(v + j * D + c * S), acc[c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      (acc[c] * V(scale)).store(result + c * S);
    }
  } else {
    std::fill(result, result + D, A(0));
    for (int64_t j = 0; j < keys; ++j) {
      const A w = weights[j] * scale;
      int64_t d = 0;
      for (; d + S <= D; d += S) {
        at::vec::fmadd(V(w), load_acc(v + j * D + d), V::loadu(result + d)).store(result + d);
      }
      for (; d < D; ++d) {
        result[d] += w * A(v[j * D + d]);
      }
    }
  }
}

// Query row `query` over keys [0, keys): scores, softmax, weighted sum of the values into `result`.
template <typename scalar_t, int C>
void attend_row(const DecodeProblem<scalar_t>& p, const acc_t<scalar_t>* query, const scalar_t* k, const scalar_t* v,
                const scalar_t* pad, int64_t keys, acc_t<scalar_t>* result, std::vector<acc_t<scalar_t>>& scores) {
  using A = acc_t<scalar_t>;
  using V = Vec<A>;
  scores.resize(keys);
  score_keys<scalar_t, C>(query, k, keys, p.D, scores.data());
  const int64_t padded = pad != nullptr ? std::min(keys, p.padding_len) : 0;
  at::vec::map([scale = A(p.scale)](V x) { return x * V(scale); }, scores.data(), scores.data(), keys);
  for (int64_t j = 0; j < padded; ++j) {
    scores[j] += A(pad[j]);
  }
  const A max = at::vec::reduce_all<A>([](V a, V b) { return at::vec::maximum(a, b); }, scores.data(), keys);
  if (max == -std::numeric_limits<A>::infinity()) {  // every key masked: zeros, as SDPA gives
    std::fill(result, result + p.D, A(0));
    return;
  }
  at::vec::map([max](V x) { return (x - V(max)).exp_u20(); }, scores.data(), scores.data(), keys);
  const A sum = at::vec::reduce_all<A>([](V a, V b) { return a + b; }, scores.data(), keys);
  weigh_values<scalar_t, C>(scores.data(), v, keys, p.D, A(1) / sum, result);
}

// The unrolled variant for the common head sizes (D = 2, 4, 8 or 16 vectors), else the general one.
template <typename scalar_t>
void attend_row(const DecodeProblem<scalar_t>& p, const acc_t<scalar_t>* query, const scalar_t* k, const scalar_t* v,
                const scalar_t* pad, int64_t keys, acc_t<scalar_t>* result, std::vector<acc_t<scalar_t>>& scores) {
  const int64_t S = Vec<acc_t<scalar_t>>::size();
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
  using A = acc_t<scalar_t>;
  const int64_t D = p.D;
  const bool fixed = p.k_new == nullptr;  // fixed keys: every row sees all M
  std::vector<A> scores, query(D), result(D);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t n = i / p.H, h = i % p.H;
    const int64_t start = fixed ? 0 : p.before[n], count = fixed ? p.T : p.added[n];
    scalar_t* k = p.k_cache + i * p.M * D;
    scalar_t* v = p.v_cache + i * p.M * D;
    if (!fixed) {
      const scalar_t* k_new = p.k_new + n * p.new_strides[0] + h * p.new_strides[1];
      const scalar_t* v_new = p.v_new + n * p.new_strides[0] + h * p.new_strides[1];
      for (int64_t t = 0; t < count; ++t) {
        std::copy(k_new + t * p.new_strides[2], k_new + t * p.new_strides[2] + D, k + (start + t) * D);
        std::copy(v_new + t * p.new_strides[2], v_new + t * p.new_strides[2] + D, v + (start + t) * D);
      }
    }
    const scalar_t* q = p.q + n * p.q_strides[0] + h * p.q_strides[1];
    const scalar_t* pad = p.padding != nullptr ? p.padding + n * p.padding_stride : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      const scalar_t* row = q + t * p.q_strides[2];
      std::transform(row, row + D, query.begin(), [](scalar_t x) { return A(x); });
      const int64_t keys = fixed ? p.M : start + t + 1;  // (a cached row sees its prefix and itself)
      attend_row(p, query.data(), k, v, pad, keys, result.data(), scores);
      std::transform(result.begin(), result.end(), p.out + (i * p.T + t) * D, [](A x) { return scalar_t(x); });
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

void decode_heads(const DecodeProblem<c10::BFloat16>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void decode_heads(const DecodeProblem<c10::Half>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

}  // namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA
