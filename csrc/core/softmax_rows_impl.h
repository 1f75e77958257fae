#pragma once

// softmax_rows.h for one instruction set: included only by softmax_rows_avx2.cpp and
// softmax_rows_avx512.cpp, which define TORCHMHA_KERNEL_ISA and are compiled with that set's
// flags (and at::vec's matching CPU_CAPABILITY, so the two copies share no symbol).

#include "softmax_rows.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace torchmha::core::kernel::TORCHMHA_KERNEL_ISA {
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

}  // namespace

void softmax_rows(const SoftmaxRows<float>& p) { run(p); }
void softmax_rows(const SoftmaxRows<double>& p) { run(p); }

}  // namespace torchmha::core::kernel::TORCHMHA_KERNEL_ISA
