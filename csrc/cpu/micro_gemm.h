#pragma once

// The per-head products of torchmha's CPU attention kernels (explicit_attention_kernel.cpp,
// blocked_attention_kernel.cpp) on raw pointers, and the pointers they read: rows of a head, rows of a
// mask. Rows are contiguous (unit stride along the last dimension); the row strides are free.

#include "common/optional_tensor.h"
#include "common/settings.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <limits>
#include <type_traits>

namespace torchmha::cpu {
using at::Tensor;
}  // namespace torchmha::cpu

namespace torchmha::cpu::micro_gemm {

/// The 2-D (rows, cols) view of row-major data at `data` with row stride `ld`.
inline Tensor matrix(void* data, int64_t rows, int64_t cols, int64_t ld, const at::TensorOptions& options) {
  return at::from_blob(data, {rows, cols}, {ld, 1}, options);
}

/// C (M x N, row stride ldc) = A (M x K, lda) B (K x N, ldb) (+ C with `accumulate`), by ATen's
/// mm_out/addmm_out on views of the memory.
template <typename scalar_t>
void matmul_aten(int64_t M, int64_t N, int64_t K, const scalar_t* A, int64_t lda, const scalar_t* B, int64_t ldb,
                 scalar_t* C, int64_t ldc, bool accumulate = false) {
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value);
  Tensor c = matrix(C, M, N, ldc, options);
  const Tensor a = matrix(const_cast<scalar_t*>(A), M, K, lda, options);
  const Tensor b = matrix(const_cast<scalar_t*>(B), K, N, ldb, options);
  accumulate ? at::addmm_out(c, c, a, b) : at::mm_out(c, a, b);
}

/// Whether `gemm` may call the BLAS's own GEMM: yes unless TORCHMHA_BLAS_GEMM=0.
inline bool blas_gemm_allowed() {
  static const bool allowed = settings::read_switch("TORCHMHA_BLAS_GEMM").value_or(true);
  return allowed;
}

/// The most multiply-adds a float `matmul` gives brgemm: 2^20, or TORCHMHA_BRGEMM_MAX_MACS (0: never).
inline int64_t brgemm_max_macs() {
  static const int64_t most =
      settings::read_count("TORCHMHA_BRGEMM_MAX_MACS", "multiply-adds a product").value_or(int64_t(1) << 20);
  return most;
}

/// The same. float, small products: the CPU BLAS's batch-reduce GEMM on raw pointers (oneDNN's
/// micro-kernel where ATen has it, else its GEMM), about 0.3 us a call against 1.1-1.5 us for
/// mm_out at 16 x 16 x 64, equal at 128 x 128 x 64. Larger ones stay with mm_out: brgemm does not
/// pack B, and over a strided V of 2048 keys it measured 1.75x slower (560 against 320 us).
inline void matmul(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                   int64_t ldc, bool accumulate = false) {
  if (M * N * K <= brgemm_max_macs()) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
  } else {
    matmul_aten(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
  }
}


// The Fortran BLAS GEMMs that torch's CPU BLAS wraps (at::native::cpublas::gemm, which libtorch
// does not export); libtorch_cpu exports its MKL's. Weak: where a symbol is absent the products
// below take ATen's addmm_out on transposed views instead, and so they do with TORCHMHA_BLAS_GEMM=0.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));
extern "C" void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
                       const double* beta, double* c, const int* ldc) __attribute__((weak));

/// Row-major C (M x N, ldc) = alpha op(A) op(B) + beta C, op(A) M x K and op(B) K x N, with A
/// (lda) and B (ldb) read transposed in place where asked: the BLAS's GEMM (column-major, so it
/// computes C^T = op(B)^T op(A)^T). beta = 0 ignores what C held.
template <typename scalar_t>
void gemm(bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K, scalar_t alpha, const scalar_t* A,
          int64_t lda, const scalar_t* B, int64_t ldb, scalar_t beta, scalar_t* C, int64_t ldc) {
  constexpr bool is_float = std::is_same_v<scalar_t, float>;
  static_assert(is_float || std::is_same_v<scalar_t, double>, "float or double");
  const auto blas = [] {
    if constexpr (is_float) {
      return sgemm_;
    } else {
      return dgemm_;
    }
  }();
  // The Fortran interface takes int sizes: anything larger goes to ATen.
  const int64_t largest = std::max({M, N, K, lda, ldb, ldc});
  if (blas_gemm_allowed() && blas != nullptr && largest <= std::numeric_limits<int>::max()) {
    const char ta = transpose_a ? 'T' : 'N', tb = transpose_b ? 'T' : 'N';
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const int ld_a = static_cast<int>(lda), ld_b = static_cast<int>(ldb), ld_c = static_cast<int>(ldc);
    blas(&tb, &ta, &m, &n, &k, &alpha, B, &ld_b, A, &ld_a, &beta, C, &ld_c);
    return;
  }
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value);
  const auto operand = [&](const scalar_t* data, int64_t rows, int64_t cols, int64_t ld, bool transpose) {
    const Tensor t = matrix(const_cast<scalar_t*>(data), transpose ? cols : rows, transpose ? rows : cols, ld, options);
    return transpose ? t.t() : t;
  };
  Tensor c = matrix(C, M, N, ldc, options);
  at::addmm_out(c, c, operand(A, M, K, lda, transpose_a), operand(B, K, N, ldb, transpose_b), beta, alpha);
}

/// matmul for double: the BLAS GEMM (cpublas::brgemm has no double kernel).
inline void matmul(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb,
                   double* C, int64_t ldc, bool accumulate = false) {
  gemm<double>(false, false, M, N, K, 1, A, lda, B, ldb, accumulate ? 1 : 0, C, ldc);
}

/// Rows of a (N, H, len, D) tensor with unit stride along D, in any order of its dimensions: row l
/// of head (n, h). `element` is const scalar_t to read them, scalar_t to write them (OutputRows).
template <typename scalar_t, typename element = const scalar_t>
struct HeadRows {
  element* data;
  int64_t stride_n, stride_h, ld;

  explicit HeadRows(const Tensor& t)
      : data(pointer(t)), stride_n(t.stride(0)), stride_h(t.stride(1)), ld(t.stride(2)) {}
  /// One head's rows, whichever (n, h) asks.
  HeadRows(element* rows, int64_t row_stride) : data(rows), stride_n(0), stride_h(0), ld(row_stride) {}
  element* operator()(int64_t n, int64_t h, int64_t l = 0) const {
    return data + n * stride_n + h * stride_h + l * ld;
  }

 private:
  static element* pointer(const Tensor& t) {
    if constexpr (std::is_const_v<element>) {
      return t.const_data_ptr<scalar_t>();
    } else {
      return t.data_ptr<scalar_t>();
    }
  }
};

/// A kernel's result rows, to write (the heads in either order of common/heads_layout.h).
template <typename scalar_t>
using OutputRows = HeadRows<scalar_t, scalar_t>;

/// Head (n, h)'s keys [0, keys) transposed into `kt` (D x keys, row stride keys): the products
/// against K^T are then brgemm calls on plain row-major blocks. brgemm takes no transposed
/// operand, and the BLAS GEMM that reads K transposed in place repacks both operands on every call.
/// bfloat16 and float16 keys are converted here, as they are transposed. `kt` grows as needed.
// In the blocked kernel, with K^T (once per head, not per block) the forward measured 0.81-0.93x
// SDPA's time at 1024^2-4096^2 scores a head, against 0.95-0.99 without (AMD EPYC, 2 threads, 5
// rounds each). Made by the task that reads it, into its own buffer, rather than for all heads in
// one pass before: it is then still in that core's cache (at 64 heads of 128^2 the forward went
// from 2.96 to 2.36 ms with this and the scale moved into the softmax step). The buffer is a
// Tensor, not a std::vector: brgemm on rows less aligned than ATen's allocations measured 10%
// slower.
template <typename scalar_t>
inline const float* transpose_head(const HeadRows<scalar_t>& rows, int64_t n, int64_t h, int64_t keys, int64_t D,
                                   Tensor& kt) {
  if (kt.numel() < D * keys) {
    kt = at::empty({D * keys}, at::kFloat);
  }
  // By 16 keys, so that each row of K^T gets a whole cache line at once from rows still in L1.
  float* out = kt.data_ptr<float>();
  for (int64_t s0 = 0; s0 < keys; s0 += 16) {
    const int64_t count = std::min<int64_t>(16, keys - s0);
    const scalar_t* first = rows(n, h, s0);
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t s = 0; s < count; ++s) {
        out[d * keys + s0 + s] = static_cast<float>(first[s * rows.ld + d]);
      }
    }
  }
  return out;
}

/// One row (n, h, l) of a mask broadcastable to (N, H, L, S), or null; `ld` gets the stride
/// between rows l (0: broadcast).
template <typename scalar_t>
const scalar_t* mask_rows(const OptionalTensor& mask, int64_t n, int64_t h, int64_t l, int64_t* ld) {
  if (!is_present(mask)) {
    *ld = 0;
    return nullptr;
  }
  const auto stride = [&](int64_t d) { return mask->size(d) == 1 ? 0 : mask->stride(d); };
  *ld = stride(2);
  return mask->const_data_ptr<scalar_t>() + n * stride(0) + h * stride(1) + l * stride(2);
}

}  // namespace torchmha::cpu::micro_gemm
