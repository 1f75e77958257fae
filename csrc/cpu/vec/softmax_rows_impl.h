#pragma once

// softmax_rows.h for one instruction set: included only by softmax_rows_avx2.cpp and
// softmax_rows_avx512.cpp, which define TORCHMHA_KERNEL_ISA and are compiled with that set's
// flags (and at::vec's matching CPU_CAPABILITY, so the two copies share no symbol).

#include "softmax_rows.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>

namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA {
namespace {

template <typename scalar_t>
using Vec = at::vec::Vectorized<scalar_t>;

// x = exp(x - max) in place; returns their sum.
template <typename scalar_t>
scalar_t exp_and_sum(scalar_t* x, scalar_t max, int64_t n) {
  using V = Vec<scalar_t>;
  V sums(scalar_t(0));
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V e = (V::loadu(x + i) - V(max)).exp_u20();
    e.store(x + i);
    sums = sums + e;
  }
  scalar_t sum = at::vec::vec_reduce_all<scalar_t>([](V a, V b) { return a + b; }, sums);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  return sum;
}

// x *= inverse in place, and the running average's row: sum = (sum + x) * sum_scale, or x *
// sum_scale where `first`.
template <typename scalar_t>
void normalize_and_add(scalar_t* x, scalar_t inverse, scalar_t* sum, bool first, scalar_t sum_scale, int64_t n) {
  using V = Vec<scalar_t>;
  const V inv(inverse), scale(sum_scale);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V a = V::loadu(x + i) * inv;
    a.store(x + i);
    (first ? a * scale : (V::loadu(sum + i) + a) * scale).store(sum + i);
  }
  for (; i < n; ++i) {
    x[i] *= inverse;
    sum[i] = first ? x[i] * sum_scale : (sum[i] + x[i]) * sum_scale;
  }
}

// Row r, as torch's softmax does it: max, exp(x - max), sum, times 1/sum. A row that is all -inf
// gives NaN (-inf - -inf), as torch's does. The scores' scale (1 when the GEMM applied it) and the
// mask come first, in one pass, then the max; exp and the sum share a pass, and so do the division
// and the average over the heads (against a pass each: 0.95 of the op's time with the average, 8 x
// 8 heads of 128 x 128 and 8 heads of 2048 x 2048, AMD EPYC Zen 3, 10 rounds alternated in one
// process).
template <typename scalar_t>
void softmax_row(const SoftmaxRows<scalar_t>& p, int64_t r) {
  using V = Vec<scalar_t>;
  scalar_t* x = p.scores + r * p.scores_ld;
  const int64_t n = p.cols;
  if (p.mask != nullptr) {
    at::vec::map2([s = V(p.scale)](V a, V b) { return a * s + b; }, x, x, p.mask + r * p.mask_ld, n);
  } else if (p.scale != scalar_t(1)) {
    at::vec::map([s = V(p.scale)](V a) { return a * s; }, x, x, n);
  }
  const scalar_t max = at::vec::reduce_all<scalar_t>([](V a, V b) { return at::vec::maximum(a, b); }, x, n);
  const scalar_t inverse = scalar_t(1) / exp_and_sum(x, max, n);
  if (p.sum != nullptr) {
    normalize_and_add(x, inverse, p.sum + r * p.sum_ld, p.first, p.sum_scale, n);
  } else {
    at::vec::map([inverse](V a) { return a * V(inverse); }, x, x, n);
  }
}

template <typename scalar_t>
void run(const SoftmaxRows<scalar_t>& p) {
  for (int64_t r = 0; r < p.rows; ++r) softmax_row(p, r);
}

void online_step(const OnlineSoftmaxRows& p) {
  using V = Vec<float>;
  for (int64_t r = 0; r < p.rows; ++r) {
    float* x = p.scores + r * p.scores_ld;
    const int64_t allowed = p.causal ? std::clamp<int64_t>(p.causal_offset + r + 1, 0, p.cols) : p.cols;
    if (p.mask != nullptr) {
      at::vec::map2([s = V(p.scale)](V a, V b) { return a * s + b; }, x, x, p.mask + r * p.mask_ld, allowed);
    } else if (p.scale != 1.f) {
      at::vec::map([s = V(p.scale)](V a) { return a * s; }, x, x, allowed);
    }
    const float block_max =
        allowed == 0 ? -INFINITY
                     : at::vec::reduce_all<float>([](V a, V b) { return at::vec::maximum(a, b); }, x, allowed);
    const float old_max = p.max[r], new_max = std::max(old_max, block_max);
    if (new_max == -INFINITY) {  // nothing allowed yet: no weight, and no exp(-inf - -inf)
      std::fill(x, x + p.cols, 0.f);
      continue;
    }
    const float block_sum = exp_and_sum(x, new_max, allowed);
    std::fill(x + allowed, x + p.cols, 0.f);
    const float rescale = std::exp(old_max - new_max);  // 0 when old_max is -inf
    p.sum[r] = p.sum[r] * rescale + block_sum;
    p.max[r] = new_max;
    if (rescale != 1.f) {
      float* acc = p.acc + r * p.acc_ld;
      at::vec::map([s = V(rescale)](V a) { return a * s; }, acc, acc, p.head_dim);
    }
  }
}

void backward_step(const SoftmaxBackwardRows& p) {
  using V = Vec<float>;
  for (int64_t r = 0; r < p.rows; ++r) {
    float *x = p.scores + r * p.ld, *g = p.grad + r * p.ld;
    const int64_t allowed = p.causal ? std::clamp<int64_t>(p.causal_offset + r + 1, 0, p.cols) : p.cols;
    const V lse(p.lse[r]), scale(p.scale);
    if (p.mask != nullptr) {
      at::vec::map2([lse, scale](V a, V m) { return (a * scale + m - lse).exp_u20(); }, x, x, p.mask + r * p.mask_ld,
                    allowed);
    } else {
      at::vec::map([lse, scale](V a) { return (a * scale - lse).exp_u20(); }, x, x, allowed);
    }
    std::fill(x + allowed, x + p.cols, 0.f);
    at::vec::map2([delta = V(p.delta[r]), scale](V prob, V dp) { return prob * (dp - delta) * scale; }, g, x, g,
                  p.cols);
  }
}

}  // namespace

void softmax_rows(const SoftmaxRows<float>& p) { run(p); }
void softmax_rows(const SoftmaxRows<double>& p) { run(p); }
void online_softmax_rows(const OnlineSoftmaxRows& p) { online_step(p); }
void softmax_backward_rows(const SoftmaxBackwardRows& p) { backward_step(p); }

}  // namespace torchmha::cpu::kernel::TORCHMHA_KERNEL_ISA
