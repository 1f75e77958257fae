// The decode kernel's inner loop (decode_kernel.h), compiled with AVX2/FMA.

#include "decode_kernel.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

namespace torchmha::core::kernel {
namespace {

template <typename scalar_t>
using Vec = at::vec::Vectorized<scalar_t>;

// Query row `query` over keys [0, keys): scores, softmax, weighted sum of the values into `result`.
template <typename scalar_t>
void attend_row(const DecodeProblem<scalar_t>& p, const scalar_t* query, const scalar_t* k, const scalar_t* v,
                const scalar_t* pad, int64_t keys, scalar_t* result, std::vector<scalar_t>& scores) {
  using V = Vec<scalar_t>;
  const int64_t D = p.D;
  scores.resize(keys);
  int64_t j = 0;
  if (D % V::size() == 0) {  // four keys at a time: four FMA chains, then one horizontal sum each
    for (; j + 4 <= keys; j += 4) {
      V acc[4] = {V(0), V(0), V(0), V(0)};
      for (int64_t d = 0; d < D; d += V::size()) {
        const V x = V::loadu(query + d);
        for (int r = 0; r < 4; ++r) {
          acc[r] = at::vec::fmadd(x, V::loadu(k + (j + r) * D + d), acc[r]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        scores[j + r] = at::vec::vec_reduce_all<scalar_t>([](V a, V b) { return a + b; }, acc[r]);
      }
    }
  }
  for (; j < keys; ++j) {
    scores[j] = at::vec::map2_reduce_all<scalar_t>(
        [](V a, V b) { return a * b; }, [](V a, V b) { return a + b; }, query, k + j * D, D);
  }
  for (j = 0; j < keys; ++j) {
    scores[j] = scores[j] * p.scale + (pad != nullptr && j < p.padding_len ? pad[j] : scalar_t(0));
  }
  const scalar_t max = at::vec::reduce_all<scalar_t>([](V a, V b) { return at::vec::maximum(a, b); }, scores.data(), keys);
  at::vec::map([max](V x) { return (x - V(max)).exp_u20(); }, scores.data(), scores.data(), keys);
  const scalar_t sum = at::vec::reduce_all<scalar_t>([](V a, V b) { return a + b; }, scores.data(), keys);
  const scalar_t inverse = scalar_t(1) / sum;
  for (int64_t key = 0; key < keys; ++key) {
    const V weight(scores[key] * inverse);
    at::vec::map2([weight](V acc, V x) { return at::vec::fmadd(weight, x, acc); }, result, result, v + key * D, D);
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
  }
}

}  // namespace

void decode_heads(const DecodeProblem<float>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

void decode_heads(const DecodeProblem<double>& p, int64_t begin, int64_t end) {
  run(p, begin, end);
}

}  // namespace torchmha::core::kernel
