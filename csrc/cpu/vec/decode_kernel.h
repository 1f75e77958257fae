#pragma once

// The inner loop of torchmha's CPU decode kernel (decode_attention_kernel.cpp), on raw pointers. It is
// compiled twice, for AVX2/FMA and for AVX-512 (decode_kernel_avx2.cpp, decode_kernel_avx512.cpp
// with decode_kernel_impl.h; CMakeLists.txt sets the flags), so at::vec is vectorized;
// decode_attention_kernel.cpp picks the copy the CPU runs (else the ATen composition runs). This header
// includes nothing of ATen's, so no inline function compiled for those sets can be shared with
// the rest of the library.

#include <cstdint>

namespace c10 {  // (declared only: bfloat16 and float16 storage, computed in float)
struct BFloat16;
struct Half;
}  // namespace c10

namespace torchmha::cpu::kernel {

/// One decoding step's problem: N sequences x H heads, rows of length D. Without k_new (null: fixed
/// keys, a decoder's memory), nothing is written and every row of q sees all M keys of k_cache.
template <typename scalar_t>
struct DecodeProblem {
  const scalar_t *q, *k_new, *v_new;   // (N, H, T, D), rows contiguous; strides below
  int64_t q_strides[3], new_strides[3];  // sequence, head, row strides of q and of k_new/v_new
  scalar_t *k_cache, *v_cache;          // (N, H, M, D) contiguous
  scalar_t* out;                        // (N, H, T, D) contiguous; rows past `added` get zeros
  const scalar_t* padding;              // (N, S) additive, row stride padding_stride; or null
  int64_t padding_stride, padding_len;
  const int64_t *before, *added;        // lengths before the step, positions added, per sequence
  int64_t H, T, M, D;
  double scale;                         // 1 / sqrt(D)
};

/// Runs (sequence, head) pairs [begin, end) of `p`: writes their new rows, then attends.
namespace avx2 {
void decode_heads(const DecodeProblem<float>& p, int64_t begin, int64_t end);
void decode_heads(const DecodeProblem<double>& p, int64_t begin, int64_t end);
void decode_heads(const DecodeProblem<c10::BFloat16>& p, int64_t begin, int64_t end);
void decode_heads(const DecodeProblem<c10::Half>& p, int64_t begin, int64_t end);
}  // namespace avx2
namespace avx512 {
void decode_heads(const DecodeProblem<float>& p, int64_t begin, int64_t end);
void decode_heads(const DecodeProblem<double>& p, int64_t begin, int64_t end);
void decode_heads(const DecodeProblem<c10::BFloat16>& p, int64_t begin, int64_t end);
void decode_heads(const DecodeProblem<c10::Half>& p, int64_t begin, int64_t end);
}  // namespace avx512

}  // namespace torchmha::cpu::kernel
