// torchmha's CPU kernels of attention that returns its weights, forward and backward, by blocks of
// query rows (kernels.h; the op's front is csrc/core/explicit_attention.cpp).

#include "cpu/kernels.h"

#include "common/heads_layout.h"
#include "common/settings.h"
#include "cpu/cpu_capability.h"
#include "cpu/micro_gemm.h"
#include "cpu/vec/softmax_rows.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace torchmha::cpu {
namespace {

using micro_gemm::gemm;
using micro_gemm::HeadRows;
using micro_gemm::mask_rows;
using micro_gemm::matmul;
using micro_gemm::matrix;
using micro_gemm::OutputRows;
using micro_gemm::transpose_head;

// The block's scores are about this many bytes, so they stay in cache between the two GEMMs and
// the softmax: half of a core's L2 on the development machine (256 KiB was 1.4x slower at
// L = 2048: the scores GEMM is then too thin).
constexpr int64_t kBlockBytes = int64_t(1024) << 10;

// Rows whose S scores fill the buffer above (8 to 256).
int64_t rows_in_buffer(int64_t S, int64_t element_size) {
  return std::clamp<int64_t>(kBlockBytes / (S * element_size), 8, 256);
}

// Q K^T as brgemm over the head's K^T (micro_gemm::transpose_head, made by the task that reads
// it), rather than the BLAS GEMM reading K transposed in place, and the whole call on one thread
// below 2^22 multiply-adds a product (N H L S D): float32, up to 128 keys, on AMD running the AVX2
// copy (Zen 3). There MKL's GEMM runs its own threads on products of 16 x 16 x 64 (6.9 us a call
// on 2 threads, 3.9 on 1) and repacks both operands each call. The op against the in-place GEMM
// on 2 threads (AMD EPYC Zen 3, 2026-12-05, heads of 64, with and without the head average,
// medians of 7 alternated rounds in one process): 0.55-0.57 of its time at 1 x 4 heads of 16^2,
// 0.56-0.60 at 1-2 x 8 of 32^2, 0.65-0.67 and 0.74-0.79 at 1 and 2 x 8 of 64^2, 0.89-0.93 at
// 1-8 x 8 of 128^2 and 4 x 8 of 96^2; at 256 keys and more (K^T made again for each block of
// rows) 1.01-1.08, so the GEMM in place stays there. Two threads against one, before: 1.98x the
// time at 1 x 4 heads of 16^2, 1.17 at 1 x 8 of 64^2 (2^21 multiply-adds), 0.95 at 2 x 8. On the
// Intel Xeon (AVX-512, 2026-11-30, with every call on the threads) the in-place GEMM took
// 0.78-0.90 of the copy's time at 1 x 4 heads of 16^2, 0.83 at 8 x 8 of 128^2, 0.9-1 at 512-2048
// keys: not there.
// TORCHMHA_TRANSPOSED_KEYS=1 takes both for every float32 call, 0 for none.
template <typename scalar_t>
bool transposes_keys(int64_t S) {
  if (!std::is_same_v<scalar_t, float>) {
    return false;
  }
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_TRANSPOSED_KEYS");
  if (forced.has_value()) {
    return *forced;
  }
  return S <= 128 && cpu_vendor() == Vendor::kAmd && cpu_capability() == Capability::kAvx2;
}

int64_t threads_for(int64_t N, int64_t H, int64_t L, int64_t S, int64_t D, bool transposed_keys) {
  return transposed_keys && N * H * L * S * D < (int64_t(1) << 22) ? 1 : at::get_num_threads();
}

// Rows per block: the buffer above, but at least 4 blocks a thread when the rows allow.
int64_t rows_per_block(int64_t N, int64_t L, int64_t S, int64_t element_size, int64_t threads) {
  int64_t rows = rows_in_buffer(S, element_size);
  const int64_t wanted = threads > 1 ? 4 * threads : 1;
  while (rows > 8 && N * ((L + rows - 1) / rows) < wanted) {
    rows /= 2;
  }
  return std::min(rows, L);
}

template <typename scalar_t>
void explicit_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                               bool average, const Tensor& heads, const Tensor& weights) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const bool transposed_keys = transposes_keys<scalar_t>(S);
  const int64_t threads = threads_for(N, H, L, S, D, transposed_keys);
  const int64_t block = rows_per_block(N, L, S, sizeof(scalar_t), threads);
  const int64_t blocks_per_sequence = (L + block - 1) / block;
  const int64_t tasks = N * blocks_per_sequence;
  const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(D)));
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  const HeadRows<scalar_t> q_rows(q), k_rows(k), v_rows(v);
  scalar_t* weights_data = weights.data_ptr<scalar_t>();
  const OutputRows<scalar_t> out_rows(heads);

  at::parallel_for(0, tasks, threads > 1 ? 1 : tasks, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;  // grad mode is per thread; inside autograd's forward the inputs require grad
    std::vector<scalar_t> buffer(average ? block * S : 0);
    Tensor kt_buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks_per_sequence, l0 = (task % blocks_per_sequence) * block;
      const int64_t rows = std::min(block, L - l0);
      for (int64_t h = 0; h < H; ++h) {
        // With the average, a block's scores live in the buffer; per head, in the result itself.
        scalar_t* scores = average ? buffer.data() : weights_data + ((n * H + h) * L + l0) * S;
        // Q K^T: brgemm over K^T, or the BLAS GEMM reading K transposed in place (transposes_keys).
        if (transposed_keys) {
          if constexpr (std::is_same_v<scalar_t, float>) {  // (transposes_keys: float only)
            matmul(rows, S, D, q_rows(n, h, l0), q_rows.ld, transpose_head(k_rows, n, h, S, D, kt_buffer), S, scores, S);
          }
        } else {
          gemm<scalar_t>(false, true, rows, S, D, 1, q_rows(n, h, l0), q_rows.ld, k_rows(n, h), k_rows.ld, 0, scores, S);
        }
        int64_t mask_ld = 0;
        const scalar_t* mask_row = mask_rows<scalar_t>(mask, n, h, l0, &mask_ld);
        const kernel::SoftmaxRows<scalar_t> step{
            scores, S, scale, mask_row, mask_ld, average ? weights_data + (n * L + l0) * S : nullptr, S, h == 0,
            static_cast<scalar_t>(h == H - 1 ? 1.0 / H : 1.0), rows, S};
        avx512 ? kernel::avx512::softmax_rows(step) : kernel::avx2::softmax_rows(step);
        matmul(rows, D, S, scores, S, v_rows(n, h), v_rows.ld, out_rows(n, h, l0), out_rows.ld);
      }
    }
  });
}

// The gradients of q, k and v from those of the heads and the weights (either may be undefined:
// zeros). Per (sequence, head), so that dK and dV accumulate over the row blocks on one thread;
// each block recomputes its probabilities P from q, k and the mask, then
//   dP = dO v^T + dW (dW / H for the average),  dS = P * (dP - rowsum(P * dP))  (torch's
//   softmax backward),  dQ = scale dS k,  dK += scale dS^T q,  dV += P^T dO.
template <typename scalar_t>
void explicit_attention_backward_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                                        bool average, const Tensor& grad_heads, const Tensor& grad_weights,
                                        const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const int64_t block = std::min(rows_in_buffer(S, sizeof(scalar_t)), L);
  const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(D)));
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  const auto options = q.options();
  const bool with_heads = grad_heads.defined(), with_weights = grad_weights.defined();
  const HeadRows<scalar_t> q_rows(q), k_rows(k), v_rows(v);
  const scalar_t* d_out_data = with_heads ? grad_heads.const_data_ptr<scalar_t>() : nullptr;  // contiguous
  const scalar_t* dw_data = with_weights ? grad_weights.const_data_ptr<scalar_t>() : nullptr;  // contiguous
  scalar_t *dq_data = dq.data_ptr<scalar_t>(), *dk_data = dk.data_ptr<scalar_t>(), *dv_data = dv.data_ptr<scalar_t>();

  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;  // (as in the forward kernel)
    std::vector<scalar_t> probabilities(block * S), grad_probabilities(block * S), grad_scores(block * S);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n = pair / H, h = pair % H;
      scalar_t *dk_nh = dk_data + pair * S * D, *dv_nh = dv_data + pair * S * D;
      for (int64_t l0 = 0; l0 < L; l0 += block) {
        const int64_t rows = std::min(block, L - l0);
        const scalar_t keep = l0 == 0 ? 0 : 1;  // beta: dK and dV accumulate over the blocks
        scalar_t *p = probabilities.data(), *dp = grad_probabilities.data();
        gemm<scalar_t>(false, true, rows, S, D, scale, q_rows(n, h, l0), q_rows.ld, k_rows(n, h), k_rows.ld, 0, p, S);
        int64_t mask_ld = 0;
        const scalar_t* mask_row = mask_rows<scalar_t>(mask, n, h, l0, &mask_ld);
        const kernel::SoftmaxRows<scalar_t> step{p, S, 1, mask_row, mask_ld, nullptr, 0, false, 1, rows, S};
        avx512 ? kernel::avx512::softmax_rows(step) : kernel::avx2::softmax_rows(step);

        if (with_weights) {  // dW, or dW / H for the average
          const scalar_t* dw = dw_data + ((average ? n : pair) * L + l0) * S;
          const scalar_t factor = average ? scalar_t(1) / H : scalar_t(1);
          std::transform(dw, dw + rows * S, dp, [factor](scalar_t x) { return x * factor; });
        }
        if (with_heads) {  // + dO v^T; dV += P^T dO
          const scalar_t* d_out = d_out_data + (pair * L + l0) * D;
          gemm<scalar_t>(false, true, rows, S, D, 1, d_out, D, v_rows(n, h), v_rows.ld, with_weights ? 1 : 0, dp, S);
          gemm<scalar_t>(true, false, S, D, rows, 1, p, S, d_out, D, keep, dv_nh, D);
        } else if (!with_weights) {
          std::fill(dp, dp + rows * S, scalar_t(0));
        }
        Tensor ds = matrix(grad_scores.data(), rows, S, S, options);
        at::_softmax_backward_data_out(ds, matrix(dp, rows, S, S, options), matrix(p, rows, S, S, options), 1,
                                       q.scalar_type());
        gemm<scalar_t>(false, false, rows, D, S, scale, grad_scores.data(), S, k_rows(n, h), k_rows.ld, 0,
                       dq_data + (pair * L + l0) * D, D);
        gemm<scalar_t>(true, false, S, D, rows, scale, grad_scores.data(), S, q_rows(n, h, l0), q_rows.ld, keep, dk_nh,
                       D);
      }
      if (!with_heads) {
        std::fill(dv_nh, dv_nh + S * D, scalar_t(0));
      }
    }
  });
}

}  // namespace

bool explicit_kernel_applies(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask) {
  const auto dtype = q.scalar_type();
  if (!explicit_kernel_serves(q.device(), dtype) || k.scalar_type() != dtype || v.scalar_type() != dtype ||
      q.dim() != 4 || q.numel() == 0 || k.dim() != 4 || k.size(2) == 0) {
    return false;
  }
  // They are read through raw pointers: shapes that disagree go to the composition, whose ATen ops
  // raise the error.
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  if (k.sizes() != at::IntArrayRef{N, H, S, D} || v.sizes() != at::IntArrayRef{N, H, S, D}) {
    return false;
  }
  const auto broadcasts = [&](int64_t dim, int64_t size) { return mask->size(dim) == size || mask->size(dim) == 1; };
  if (is_present(mask) && (mask->dim() != 4 || !broadcasts(0, N) || !broadcasts(1, H) || !broadcasts(2, L))) {
    return false;
  }
  // Rows of q, k and v, and the mask's rows, are read in place: contiguous along D and the keys,
  // and (for the GEMMs) rows that do not overlap.
  const auto rows_contiguous = [](const Tensor& t) {
    return (t.stride(3) == 1 || t.size(3) == 1) && t.stride(2) >= t.size(3);
  };
  if (!rows_contiguous(q) || !rows_contiguous(k) || !rows_contiguous(v)) {
    return false;
  }
  return !is_present(mask) || (mask->scalar_type() == dtype && mask->size(3) == S && mask->stride(3) == 1);
}

std::optional<std::tuple<Tensor, Tensor>> attention_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                 const OptionalTensor& mask, bool average,
                                                                 bool batch_major) {
  if (!explicit_kernel_applies(q, k, v, mask)) {
    return std::nullopt;
  }
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  Tensor heads = empty_heads(N, H, L, D, q.options(), batch_major);
  Tensor weights = at::empty(average ? std::vector<int64_t>{N, L, S} : std::vector<int64_t>{N, H, L, S}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_with_weights_cpu", [&] {
    explicit_attention_kernel<scalar_t>(q, k, v, mask, average, heads, weights);
  });
  return std::make_tuple(heads, weights);
}

std::tuple<Tensor, Tensor, Tensor> attention_with_weights_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                   const OptionalTensor& mask, bool average,
                                                                   const Tensor& grad_heads,
                                                                   const Tensor& grad_weights) {
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  const Tensor heads_grad = grad_heads.defined() ? grad_heads.contiguous() : Tensor();
  const Tensor weights_grad = grad_weights.defined() ? grad_weights.contiguous() : Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_with_weights_backward", [&] {
    explicit_attention_backward_kernel<scalar_t>(q, k, v, mask, average, heads_grad, weights_grad, dq, dk, dv);
  });
  return {dq, dk, dv};
}

bool explicit_kernel_serves(const at::Device& device, at::ScalarType dtype) {
  return device.is_cpu() && (dtype == at::kFloat || dtype == at::kDouble) && cpu_capability() != Capability::kNone;
}

bool explicit_kernel_pays_off(int64_t L, int64_t S) {
  // Measured (benchmarks/README, issue 14): with every per-head product a BLAS GEMM on raw pointers
  // the kernels beat or tie the composition at every size, float (eval: 0.62-0.72 of torch against
  // 0.81-0.97 at 16^2-256^2 scores a head) and double (the kernels over the composition, medians of
  // 3 alternated runs: 0.86 at 16^2, 0.92 at 128^2, 0.65 at 362^2). So no threshold unless set.
  static const int64_t least = settings::read_count("TORCHMHA_MIN_KERNEL_SCORES", "scores a head").value_or(0);
  return L * S >= least;
}

}  // namespace torchmha::cpu
