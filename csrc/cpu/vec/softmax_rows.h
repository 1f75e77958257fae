#pragma once

// The row steps of torchmha's CPU attention kernels, on raw pointers: softmax of a block of score
// rows in place with the running head average (explicit_attention_kernel.cpp), and the running softmax
// over blocks of keys (blocked_attention_kernel.cpp). Compiled
// twice, for AVX2/FMA and for AVX-512 (softmax_rows_{avx2,avx512}.cpp with softmax_rows_impl.h,
// flags in CMakeLists.txt), like the decode kernel (decode_kernel.h); this header includes
// nothing of ATen's for the same reason.

#include <cstdint>

namespace torchmha::cpu::kernel {

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

/// One block of keys in torchmha's blocked attention (blocked_attention_kernel.cpp), the running
/// ("online") softmax of flash attention: the block's `rows` x `cols` scores (row stride
/// scores_ld) become scale * scores + mask, with keys past row r's causal limit (key j > r +
/// causal_offset, when `causal`) left out; then per row, with m the row's running max and m' the
/// new one, the scores become exp(x - m') in place (0 where left out), sum = sum * exp(m - m') +
/// their sum, and the row's `head_dim` accumulated outputs (row stride acc_ld) are multiplied by
/// exp(m - m'). A row with no allowed key so far keeps max -inf, sum 0 and zeros.
struct OnlineSoftmaxRows {
  float* scores;
  int64_t scores_ld;
  float scale;
  const float* mask;  // additive, or null; row stride mask_ld (0: one row for every row)
  int64_t mask_ld;
  bool causal;
  int64_t causal_offset;  // the first query row's index minus the block's first key's
  float* max;
  float* sum;
  float* acc;
  int64_t acc_ld, head_dim;
  int64_t rows, cols;
};

/// The backward's row step over one block of keys: the `rows` x `cols` scores x (row stride
/// ld, not yet scaled) become the probabilities P = exp(scale * x + mask - lse) (0 past the causal
/// limit, as above, and where lse is +inf), and the gradients dP in `grad` (same layout) become
/// dS = P (dP - delta) * scale.
struct SoftmaxBackwardRows {
  float* scores;
  float* grad;
  int64_t ld;
  const float* mask;  // additive, or null; row stride mask_ld
  int64_t mask_ld;
  bool causal;
  int64_t causal_offset;
  const float* lse;
  const float* delta;
  float scale;
  int64_t rows, cols;
};

namespace avx2 {
void softmax_rows(const SoftmaxRows<float>& p);
void softmax_rows(const SoftmaxRows<double>& p);
void online_softmax_rows(const OnlineSoftmaxRows& p);
void softmax_backward_rows(const SoftmaxBackwardRows& p);
}  // namespace avx2
namespace avx512 {
void softmax_rows(const SoftmaxRows<float>& p);
void softmax_rows(const SoftmaxRows<double>& p);
void online_softmax_rows(const OnlineSoftmaxRows& p);
void softmax_backward_rows(const SoftmaxBackwardRows& p);
}  // namespace avx512

}  // namespace torchmha::cpu::kernel
