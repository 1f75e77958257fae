// torchmha's blocked CPU kernel: attention without its weights by blocks of queries and keys,
// flash attention's running softmax (kernels.h; the op's front is csrc/core/blocked_attention.cpp).

#include "cpu/kernels.h"

#include "common/heads_layout.h"
#include "common/settings.h"
#include "cpu/cpu_capability.h"
#include "cpu/micro_gemm.h"
#include "cpu/vec/softmax_rows.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace torchmha::cpu {

namespace {

using micro_gemm::HeadRows;
using micro_gemm::mask_rows;
using micro_gemm::OutputRows;
using micro_gemm::matmul;
using micro_gemm::gemm;
using micro_gemm::transpose_head;

// Query rows per block, and keys per block so that a block's products stay micro-GEMMs
// (micro_gemm::matmul: up to 2^20 multiply-adds).
constexpr int64_t kQueryRows = 64;
int64_t keys_per_block(int64_t rows, int64_t D, int64_t S) {
  return std::min(S, std::clamp<int64_t>((int64_t(1) << 20) / (rows * D), 16, 256));
}

// The keys a block of query rows [l0, l0 + rows) reads: all, or up to its last row (causal).
int64_t keys_read(int64_t l0, int64_t rows, int64_t S, bool is_causal) {
  return is_causal ? std::min(S, l0 + rows) : S;
}

void online_softmax_rows(const kernel::OnlineSoftmaxRows& step) {
  cpu_capability() == Capability::kAvx512 ? kernel::avx512::online_softmax_rows(step)
                                          : kernel::avx2::online_softmax_rows(step);
}

void softmax_backward_rows(const kernel::SoftmaxBackwardRows& step) {
  cpu_capability() == Capability::kAvx512 ? kernel::avx512::softmax_backward_rows(step)
                                          : kernel::avx2::softmax_backward_rows(step);
}

// Head (n, h)'s rows [first, last) in float32: float32 rows as they are; bfloat16 and float16 rows
// converted into `buffer` (rows before `first` unwritten), by the task that reads them. Converting
// whole tensors up front (three copies the size of q, k and v) cost more than the kernel on small
// heads: glibc hands such blocks back to the kernel when they are freed, and every call faulted
// them in again (bfloat16 at 8 x 8 heads of 128 x 64, AMD EPYC Zen 3: 12.1 ms against 5.2 in
// float32; with glibc's thresholds raised past them, 6.1 against 4.6).
template <typename scalar_t>
HeadRows<float> float_rows(const HeadRows<scalar_t>& rows, int64_t n, int64_t h, int64_t first, int64_t last,
                           int64_t D, Tensor& buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return rows;
  } else {
    if (buffer.numel() < last * D) {
      buffer = at::empty({last * D}, at::kFloat);
    }
    float* out = buffer.data_ptr<float>();
    for (int64_t l = first; l < last; ++l) {
      at::vec::convert(rows(n, h, l), out + l * D, D);
    }
    return HeadRows<float>(out, D);
  }
}

// What every block of the forward reads and writes (float32; q, k and v per task).
struct ForwardProblem {
  const OptionalTensor& mask;
  bool is_causal;
  int64_t N, H, L, D, S, block, key_block;
  float scale;
  OutputRows<float> heads;  // (N, H, L, D)
  float* lse;               // (N, H, L)
};

// One thread's scratch: a block's scores, its accumulated rows, their running max and sum.
struct ForwardScratch {
  std::vector<float> scores, acc, max, sum;
  ForwardScratch(const ForwardProblem& p)
      : scores(p.block * p.key_block), acc(p.block * p.D), max(p.block), sum(p.block) {}
};

// Query rows [l0, l0 + rows) of head (n, h), over the blocks of keys: the block's scores (one
// micro-GEMM against K^T, `kt` with row stride kt_ld), scaled and masked in the running softmax,
// the accumulated P V (another); then the rows divided by their sums, and their log-sum-exp.
void forward_block(const ForwardProblem& p, ForwardScratch& s, const HeadRows<float>& q_rows,
                   const HeadRows<float>& v_rows, int64_t n, int64_t h, int64_t l0, int64_t rows, const float* kt,
                   int64_t kt_ld) {
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.max.begin(), s.max.end(), -INFINITY);
  std::fill(s.sum.begin(), s.sum.end(), 0.f);
  int64_t mask_ld = 0;
  const float* mask_row = mask_rows<float>(p.mask, n, h, l0, &mask_ld);
  const int64_t keys = keys_read(l0, rows, p.S, p.is_causal), D = p.D;
  for (int64_t s0 = 0; s0 < keys; s0 += p.key_block) {
    const int64_t cols = std::min(p.key_block, keys - s0);
    matmul(rows, cols, D, q_rows(n, h, l0), q_rows.ld, kt + s0, kt_ld, s.scores.data(), p.key_block);
    online_softmax_rows({s.scores.data(), p.key_block, p.scale, mask_row == nullptr ? nullptr : mask_row + s0,
                         mask_ld, p.is_causal, l0 - s0, s.max.data(), s.sum.data(), s.acc.data(), D, D, rows, cols});
    matmul(rows, D, cols, s.scores.data(), p.key_block, v_rows(n, h, s0), v_rows.ld, s.acc.data(), D,
           /*accumulate=*/true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const bool any = s.sum[r] > 0.f;
    const float inverse = any ? 1.f / s.sum[r] : 0.f;
    float* out = p.heads(n, h, l0 + r);
    for (int64_t d = 0; d < D; ++d) {
      out[d] = s.acc[r * D + d] * inverse;
    }
    p.lse[(n * p.H + h) * p.L + l0 + r] = any ? s.max[r] + std::log(s.sum[r]) : INFINITY;
  }
}

// Tasks are runs of query blocks of one head (one run a head unless the heads are fewer than the
// threads), each with its head's K^T (transpose_head) and its rows in float32 (float_rows), then
// forward_block per block.
template <typename scalar_t>
void forward_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask, bool is_causal,
                    const Tensor& heads, const Tensor& lse) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const int64_t block = std::min(kQueryRows, L);
  const ForwardProblem p{mask, is_causal, N, H, L, D, S, block, keys_per_block(block, D, S),
                         static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))), OutputRows<float>(heads),
                         lse.data_ptr<float>()};
  const HeadRows<scalar_t> q_in(q), k_in(k), v_in(v);
  const int64_t blocks_per_head = (L + block - 1) / block;
  const int64_t runs_per_head = std::min(blocks_per_head, (4 * at::get_num_threads() + N * H - 1) / (N * H));
  const int64_t rows_per_run = (blocks_per_head + runs_per_head - 1) / runs_per_head * block;

  at::parallel_for(0, N * H * runs_per_head, 1, [&](int64_t begin, int64_t end) {
    ForwardScratch scratch(p);
    Tensor kt_buffer, q_buffer, v_buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / (H * runs_per_head), h = task / runs_per_head % H;
      const int64_t first = task % runs_per_head * rows_per_run, last = std::min(L, first + rows_per_run);
      if (first >= last) {
        continue;
      }
      const int64_t run_keys = keys_read(first, last - first, S, is_causal);
      const float* kt = transpose_head(k_in, n, h, run_keys, D, kt_buffer);
      const HeadRows<float> q_rows = float_rows(q_in, n, h, first, last, D, q_buffer);
      const HeadRows<float> v_rows = float_rows(v_in, n, h, 0, run_keys, D, v_buffer);
      for (int64_t l0 = first; l0 < last; l0 += block) {
        forward_block(p, scratch, q_rows, v_rows, n, h, l0, std::min(block, last - l0), kt, run_keys);
      }
    }
  });
}

// float32, bfloat16 or float16 q, k and v (blocked_kernel_applies); a float32 mask.
void blocked_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                              bool is_causal, const Tensor& heads, const Tensor& lse) {
  switch (q.scalar_type()) {
    case at::kFloat: return forward_kernel<float>(q, k, v, mask, is_causal, heads, lse);
    case at::kBFloat16: return forward_kernel<c10::BFloat16>(q, k, v, mask, is_causal, heads, lse);
    case at::kHalf: return forward_kernel<c10::Half>(q, k, v, mask, is_causal, heads, lse);
    default: TORCH_INTERNAL_ASSERT(false, "blocked_attention_kernel: ", q.scalar_type(), " (blocked_kernel_applies)");
  }
}

// The gradients of q, k and v (float32, contiguous (N, H, len, D), written whole). Per (sequence,
// head), so that dK and dV accumulate over the query blocks on one thread. Each block of scores is
// recomputed and its probabilities taken from the saved log-sum-exp, P = exp(x - lse); then
//   dP = dO V^T,  dS = P (dP - rowsum(dO * O)) / sqrt(D),  dQ += dS K,  dK += dS^T q,  dV += P^T dO.
void blocked_attention_backward_kernel(const Tensor& grad_heads, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const OptionalTensor& mask, bool is_causal, const Tensor& heads,
                                       const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const int64_t block = std::min(kQueryRows, L), key_block = keys_per_block(block, D, S);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const HeadRows<float> q_rows(q), k_rows(k), v_rows(v), o_rows(heads), do_rows(grad_heads);
  const float* lse_data = lse.const_data_ptr<float>();
  float *dq_data = dq.data_ptr<float>(), *dk_data = dk.data_ptr<float>(), *dv_data = dv.data_ptr<float>();

  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(block * key_block), dp(block * key_block), delta(block);
    Tensor kt_buffer, vt_buffer;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n = pair / H, h = pair % H;
      const float* kt = transpose_head(k_rows, n, h, S, D, kt_buffer);
      const float* vt = transpose_head(v_rows, n, h, S, D, vt_buffer);
      float *dq_nh = dq_data + pair * L * D, *dk_nh = dk_data + pair * S * D, *dv_nh = dv_data + pair * S * D;
      std::fill(dq_nh, dq_nh + L * D, 0.f);
      std::fill(dk_nh, dk_nh + S * D, 0.f);
      std::fill(dv_nh, dv_nh + S * D, 0.f);
      for (int64_t l0 = 0; l0 < L; l0 += block) {
        const int64_t rows = std::min(block, L - l0);
        for (int64_t r = 0; r < rows; ++r) {
          const float *o = o_rows(n, h, l0 + r), *d_o = do_rows(n, h, l0 + r);
          delta[r] = std::inner_product(o, o + D, d_o, 0.f);
        }
        int64_t mask_ld = 0;
        const float* mask_row = mask_rows<float>(mask, n, h, l0, &mask_ld);
        const float* row_lse = lse_data + pair * L + l0;
        const int64_t keys = keys_read(l0, rows, S, is_causal);
        for (int64_t s0 = 0; s0 < keys; s0 += key_block) {
          const int64_t cols = std::min(key_block, keys - s0);
          matmul(rows, cols, D, q_rows(n, h, l0), q_rows.ld, kt + s0, S, p.data(), key_block);
          matmul(rows, cols, D, do_rows(n, h, l0), do_rows.ld, vt + s0, S, dp.data(), key_block);
          softmax_backward_rows({p.data(), dp.data(), key_block, mask_row == nullptr ? nullptr : mask_row + s0, mask_ld,
                                 is_causal, l0 - s0, row_lse, delta.data(), scale, rows, cols});
          matmul(rows, D, cols, dp.data(), key_block, k_rows(n, h, s0), k_rows.ld, dq_nh + l0 * D, D, true);
          gemm(true, false, cols, D, rows, 1.f, dp.data(), key_block, q_rows(n, h, l0), q_rows.ld, 1.f, dk_nh + s0 * D,
               D);
          gemm(true, false, cols, D, rows, 1.f, p.data(), key_block, do_rows(n, h, l0), do_rows.ld, 1.f, dv_nh + s0 * D,
               D);
        }
      }
    }
  });
}

Tensor float32(const Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }
OptionalTensor float32(const OptionalTensor& t) { return is_present(t) ? OptionalTensor(float32(*t)) : t; }

// A mask of fewer dimensions as its broadcast 4-D view (SDPA takes both).
OptionalTensor mask_4d(const OptionalTensor& mask) {
  if (!is_present(mask) || mask->dim() >= 4) {
    return mask;
  }
  Tensor view = *mask;
  while (view.dim() < 4) {
    view = view.unsqueeze(0);
  }
  return view;
}

}  // namespace

bool blocked_kernel_applies(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& any_mask) {
  const OptionalTensor mask = mask_4d(any_mask);
  const auto dtype = q.scalar_type();
  const bool served_dtype = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!q.device().is_cpu() || !served_dtype || cpu_capability() == Capability::kNone || k.scalar_type() != dtype ||
      v.scalar_type() != dtype || q.dim() != 4 || q.numel() == 0 || k.dim() != 4 || k.size(2) == 0) {
    return false;
  }
  // Read through raw pointers: shapes that disagree go to the composition, which raises ATen's error.
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  if (k.sizes() != at::IntArrayRef{N, H, S, D} || v.sizes() != at::IntArrayRef{N, H, S, D}) {
    return false;
  }
  const auto rows_contiguous = [](const Tensor& t) {
    return (t.stride(3) == 1 || t.size(3) == 1) && t.stride(2) >= t.size(3);
  };
  if (!rows_contiguous(q) || !rows_contiguous(k) || !rows_contiguous(v)) {
    return false;
  }
  if (!is_present(mask)) {
    return true;
  }
  const auto broadcasts = [&](int64_t dim, int64_t size) { return mask->size(dim) == size || mask->size(dim) == 1; };
  return mask->dim() == 4 && broadcasts(0, N) && broadcasts(1, H) && broadcasts(2, L) && mask->size(3) == S &&
      mask->stride(3) == 1 && mask->scalar_type() == dtype;
}

std::optional<std::tuple<Tensor, Tensor>> blocked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                                            const OptionalTensor& mask, bool is_causal,
                                                            bool batch_major) {
  if (!blocked_kernel_applies(q, k, v, mask)) {
    return std::nullopt;
  }
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  // bfloat16 and float16 are computed in float32: q, k and v converted head by head in the kernel,
  // the mask and the output here.
  const OptionalTensor mask32 = float32(mask_4d(mask));
  const auto options = q.options().dtype(at::kFloat);
  Tensor heads = empty_heads(N, H, L, D, options, batch_major);
  Tensor lse = at::empty({N, H, L}, options);
  blocked_attention_kernel(q, k, v, mask32, is_causal, heads, lse);
  return std::make_tuple(heads.to(q.scalar_type()), lse);  // (a conversion keeps the order)
}

std::optional<std::tuple<Tensor, Tensor, Tensor>> blocked_attention_backward(
    const Tensor& grad_heads, const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
    bool is_causal, const Tensor& heads, const Tensor& lse) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  if (!blocked_kernel_applies(q, k, v, mask) || grad_heads.sizes() != q.sizes() || heads.sizes() != q.sizes() ||
      lse.sizes() != at::IntArrayRef{N, H, L} || lse.scalar_type() != at::kFloat) {
    return std::nullopt;
  }
  const auto options = q.options().dtype(at::kFloat);
  Tensor dq = at::empty(q.sizes(), options), dk = at::empty(k.sizes(), options), dv = at::empty(v.sizes(), options);
  blocked_attention_backward_kernel(float32(grad_heads).contiguous(), float32(q), float32(k), float32(v),
                                    float32(mask_4d(mask)), is_causal, float32(heads), lse.contiguous(), dq, dk, dv);
  const auto dtype = q.scalar_type();
  return std::make_tuple(dq.to(dtype), dk.to(dtype), dv.to(dtype));
}

// ------------------------------------------------------------------------------ dispatch rule

bool blocked_kernel_pays_off(const Tensor& q, const Tensor& k, bool is_causal, bool with_grad) {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_BLOCKED_KERNEL");
  if (forced.has_value()) {
    return *forced;
  }
  // Measured against SDPA at head size 64 (benchmarks/README; time ratios, medians of alternated
  // rounds). On an Intel Xeon with AVX-512, without AMX (issue 14): below 128^2 scores a head
  // SDPA's fixed costs are lower (1.2-1.9x).
  //  - bfloat16: computed in float32 here, SDPA's bfloat16 GEMMs were slower: 0.7-0.9 forward,
  //    0.2-0.7 forward+backward. float16: forward 0.9-1.2 (SDPA kept: this CPU has AVX512-FP16),
  //    forward+backward 0.1-0.9 from 16^2. Not where AMX serves SDPA (not measured).
  //  - float16 forward without AVX512-FP16 (AMD EPYC, 2026-12-02, 3 rounds): 0.24-0.78 from 128^2
  //    (causal or not, up to 2048^2); below, 0.34-0.55, but 64^2 causal 0.62-1.24. So the bfloat16
  //    forward rule there.
  //  - float32 causal: 0.66-0.88 forward up to 1024^2, 1.0 beyond; 0.56-0.86 forward+backward.
  //  - float32 otherwise: forward 0.81-0.99 at 128^2 (four runs), 0.94-1.04 at 256^2, 0.93-1.14 at
  //    512^2, 1.0-1.2 beyond (SDPA kept there); forward+backward 0.63-0.97 up to 512^2 (the backward
  //    recomputes from the log-sum-exp), 1.07-1.22 at 2048^2.
  // On an AMD EPYC (avx512f, avx512_bf16, no AMX; issue 26, 2026-12-02), float32 with K^T copied
  // per head, at 1024^2, 2048^2, 4096^2 (medians of 5 alternated rounds): forward 0.96, 0.81,
  // 0.85; forward+backward 0.81, 0.77, 0.81; causal forward 0.70, 0.77, 0.79; causal
  // forward+backward 0.62, 0.69, 0.76 (before the copy: 0.95-1.01 forward, 0.91-0.97 with the
  // backward). The kernel runs there at 125-158 GFLOP/s, about torch.mm's rate.
  // On an Intel Xeon with AMX (avx512f, amx_bf16, avx512_fp16; 2026-12-03), float32 with the K^T
  // copy, 4 alternated rounds: forward 0.91-0.95 at 512^2 (N = 1, 2), 0.99-1.0 at 768^2, 0.94-1.09
  // at 1024^2 to 8192^2 (263-293 GFLOP/s, SDPA 266-295: a tie), 0.92-1.10 at 256^2; one round:
  // forward+backward 0.83-0.86 up to 512^2, 0.94-0.99 beyond; causal 0.53-0.89 up to 4096^2. So
  // on Intel with AVX-512 the forward bound is 512^2 (was 256^2, measured before the copy).
  // On an AMD EPYC without AVX-512 (Zen 3: family 25 model 1, AVX2 only; 2026-12-02, min of 3
  // rounds, 8 heads of 64): the kernel runs at 107-110 GFLOP/s at 1024^2-4096^2, SDPA at 139-142.
  // Forward 0.70, 0.90, 0.91 at 128^2-512^2, 1.28-1.31 from 1024^2; forward+backward 0.59-0.91 up
  // to 512^2, 1.20 and 1.11 at 1024^2 and 2048^2; causal forward 0.28-0.59 up to 512^2, 0.95 at
  // 1024^2, 1.07 and 1.16 at 2048^2 and 4096^2; causal forward+backward 0.56-0.94 up to 2048^2.
  // So on AMD the AVX-512 sizes hold only where the AVX-512 copy runs (cpu_capability, which
  // TORCHMHA_CPU_CAPABILITY=avx2 lowers). bfloat16 there (2026-12-04, 3 rounds, with q, k and v
  // converted head by head): forward 0.79, 0.93, 0.97 at 128^2-512^2, 1.03 at 768^2, 1.23-1.27
  // from 1024^2; causal forward 0.90 at 1024^2, 1.06 and 1.15 at 2048^2 and 4096^2; forward+backward
  // 0.19-0.21 at 1024^2 and 2048^2. float16 there: forward 0.44-0.86 at 128^2-4096^2, causal
  // 0.63-0.74 (SDPA's float16 is slower than its bfloat16 on AVX2). Below 128^2 there (5 rounds, 8
  // x 8 heads unless said): bfloat16 0.56, 0.77, 0.76, 0.76 at 16^2, 32^2, 64^2, 96^2, 0.77-0.80
  // at 16^2 and 64^2 with 8 heads of one sequence, 0.98 with one head of 64^2, causal 64^2 0.78;
  // float16 0.48-0.73, one head of 64^2 0.69. So the AVX2 copy takes both from 16^2.
  const int64_t scores = q.size(2) * k.size(2);
  const auto dtype = q.scalar_type();
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  if (dtype == at::kBFloat16 || dtype == at::kHalf) {
    if (cpu_has_amx(dtype)) {
      return false;
    }
    if (dtype == at::kHalf && with_grad) {
      return true;
    }
    const bool sdpa_native = dtype == at::kHalf && cpu_has_avx512_fp16();  // its float16 GEMMs
    // (the AVX2 copy's bfloat16 forward: float32's bounds there, measured on AMD, taken everywhere)
    const int64_t most = dtype == at::kBFloat16 && !avx512 && !with_grad ? (is_causal ? 1024 * 1024 : 512 * 512)
                                                                          : std::numeric_limits<int64_t>::max();
    const int64_t least = avx512 ? 128 * 128 : 16 * 16;
    return !sdpa_native && scores >= least && scores <= most;
  }
  // float32: the kernel from `least` to `most` scores a head, as measured on each CPU kind above.
  // Hygon (Zen cores, not measured), other vendors and Intel's AVX2 copy get the Intel sizes from
  // before the K^T copy (a forward up to 256^2), which keep SDPA at large sizes.
  const Vendor vendor = cpu_vendor();
  constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();
  const int64_t least = with_grad && !is_causal ? 64 * 64 : 128 * 128;
  int64_t most = with_grad || (avx512 && vendor == Vendor::kIntel) ? 512 * 512 : 256 * 256;
  if (is_causal) {
    most = vendor == Vendor::kAmd && !avx512 && !with_grad ? 1024 * 1024 : kUnbounded;
  } else if (vendor == Vendor::kAmd) {
    most = avx512 ? kUnbounded : 512 * 512;
  }
  return scores >= least && scores <= most;
}

bool sdpa_takes_contiguous_heads(const Tensor& q, const Tensor& k, bool is_causal, bool with_grad) {
  if (!q.device().is_cpu() || !at::isFloatingType(q.scalar_type())) {
    return false;
  }
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_SDPA_CONTIGUOUS");
  if (forced.has_value()) {
    return *forced;
  }
  // SDPA's float32 forward over the heads as views of the packed projection (rows 3E apart),
  // against the same heads copied to (N, H, L, D) first, the copy counted (AMD EPYC Zen 3, 2 threads,
  // heads of 64, medians of 5 alternated rounds in one process, 2026-12-05): 0.98-1.0 at 1024^2
  // scores a head, 0.96-1.0 at 2048^2, 0.94-0.96 at 4096^2, 0.97 at 8192^2; 1.02 at 512^2; causal
  // 1.01 at 2048^2, 0.99 at 4096^2; bfloat16 1.01 at 1024^2 and 2048^2. Not measured on the other
  // kinds, where the copy (3.4% of the call at 1024^2) might buy nothing: views there, as before.
  const bool zen3 = cpu_vendor() == Vendor::kAmd && cpu_capability() == Capability::kAvx2;
  return zen3 && q.scalar_type() == at::kFloat && !is_causal && !with_grad && q.size(2) * k.size(2) >= 1024 * 1024;
}

}  // namespace torchmha::cpu
