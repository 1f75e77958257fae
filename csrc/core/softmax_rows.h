#pragma once

// The row step of torchmha's explicit-weights CPU kernel (explicit_attention.cpp), on raw
// pointers: softmax of a block of score rows in place, and the running head average. Compiled
// twice, for AVX2/FMA and for AVX-512 (softmax_rows_{avx2,avx512}.cpp with softmax_rows_impl.h,
// flags in CMakeLists.txt), like the decode kernel (decode_kernel.h); this header includes
// nothing of ATen's for the same reason.

#include <cstdint>

namespace torchmha::core::kernel {

/// `rows` rows of `cols` scores (row stride scores_ld) become softmax(scale * scores + mask) in place.
/// With `sum`, each row of probabilities is also added to the matching row of `sum` (or stored
/// there when `first`), and the result multiplied by `sum_scale`: over the heads, the average.
template <typename scalar_t>
struct SoftmaxRows {
  scalar_t* scores;
  int64_t scores_ld;
  scalar_t scale;
  const scalar_t* mask;  // additive, or null; row stride mask_ld (0: one row for every row)
  int64_t mask_ld;
  scalar_t* sum;  // or null
  int64_t sum_ld;
  bool first;
  scalar_t sum_scale;
  int64_t rows, cols;
};

namespace avx2 {
void softmax_rows(const SoftmaxRows<float>& p);
void softmax_rows(const SoftmaxRows<double>& p);
}  // namespace avx2
namespace avx512 {
void softmax_rows(const SoftmaxRows<float>& p);
void softmax_rows(const SoftmaxRows<double>& p);
}  // namespace avx512

}  // namespace torchmha::core::kernel
