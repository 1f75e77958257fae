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

// One row, as torch's softmax does it: max, exp(x - max), sum, times 1/sum. A row that is all
// -inf gives NaN (-inf - -inf), as torch's does. The scores' scale (1 when the GEMM applied it)
// and the mask come first, in one pass.
template <typename scalar_t>
void softmax_row(scalar_t* x, scalar_t scale, const scalar_t* mask, int64_t n) {
  using V = Vec<scalar_t>;
  if (mask != nullptr) {
    at::vec::map2([s = V(scale)](V a, V b) { return a * s + b; }, x, x, mask, n);
  } else if (scale != scalar_t(1)) {
    at::vec::map([s = V(scale)](V a) { return a * s; }, x, x, n);
  }
  const scalar_t max = at::vec::reduce_all<scalar_t>([](V a, V b) { return at::vec::maximum(a, b); }, x, n);
  at::vec::map([max](V a) { return (a - V(max)).exp_u20(); }, x, x, n);
  const scalar_t sum = at::vec::reduce_all<scalar_t>([](V a, V b) { return a + b; }, x, n);
  const scalar_t inverse = scalar_t(1) / sum;
  at::vec::map([inverse](V a) { return a * V(inverse); }, x, x, n);
}

template <typename scalar_t>
void run(const SoftmaxRows<scalar_t>& p) {
  using V = Vec<scalar_t>;
  for (int64_t r = 0; r < p.rows; ++r) {
    scalar_t* x = p.scores + r * p.scores_ld;
    softmax_row(x, p.scale, p.mask == nullptr ? nullptr : p.mask + r * p.mask_ld, p.cols);
    if (p.sum == nullptr) {
      continue;
    }
    scalar_t* sum = p.sum + r * p.sum_ld;
    const V scale(p.sum_scale);
    if (p.first) {
      at::vec::map([scale](V a) { return a * scale; }, sum, x, p.cols);
    } else {
      at::vec::map2([scale](V a, V b) { return (a + b) * scale; }, sum, sum, x, p.cols);
    }
  }
}

// x = exp(x - max) in place; returns their sum.
float exp_and_sum(float* x, float max, int64_t n) {
  using V = Vec<float>;
  V sums(0.f);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V e = (V::loadu(x + i) - V(max)).exp_u20();
    e.store(x + i);
    sums = sums + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](V a, V b) { return a + b; }, sums);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  return sum;
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
