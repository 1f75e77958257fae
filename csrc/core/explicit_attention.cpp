// Attention that returns its weights (explicit_attention.h).

#include "explicit_attention.h"

#include "cpu_capability.h"
#include "softmax_rows.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace torchmha::core {

std::pair<Tensor, Tensor> attention_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const OptionalTensor& mask, bool average) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchmha::attention_with_weights", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                         const OptionalTensor&, bool)>();
  auto [heads, weights] = op.call(q, k, v, mask, average);
  return {heads, weights};
}

std::pair<Tensor, Tensor> attention_with_weights_composition(const Tensor& q, const Tensor& k, const Tensor& v,
                                                             const OptionalTensor& mask, double dropout_p,
                                                             bool average) {
  // bmm over the N*H heads (reshape copies strided heads once; 4-D matmul would add more ops).
  // The 1/sqrt(D) scale is the GEMM's alpha rather than a pass over q (torch scales q; the two
  // agree to rounding, exactly when D is a power of 4). beta = 0 ignores the input, so a
  // zero-stride placeholder serves.
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto ignored_input = at::empty({1, 1, 1}, q.options()).expand({N * H, L, S});
  auto scores = at::baddbmm(ignored_input, q.reshape({N * H, L, D}), k.reshape({N * H, S, D}).transpose(1, 2),
                            /*beta=*/0, /*alpha=*/scale)
                    .view({N, H, L, S});
  // In place on the GEMM's fresh output (its backward reads only its inputs): spares an
  // N*H*L*S allocation.
  if (is_present(mask)) {
    scores.add_(*mask);
  }
  auto weights = at::softmax(scores, -1);
  if (dropout_p > 0.0) {
    weights = at::dropout(weights, dropout_p, /*train=*/true);
  }
  auto output = at::bmm(weights.reshape({N * H, L, S}), v.reshape({N * H, S, D})).view({N, H, L, D});
  return {output, average ? weights.mean(1) : weights};
}

std::tuple<Tensor, Tensor> attention_with_weights_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                                            const OptionalTensor& mask, bool average) {
  auto [heads, weights] = attention_with_weights_composition(q, k, v, mask, /*dropout_p=*/0.0, average);
  // The CPU kernel's layout, heads in (L, N, H, D) memory (fake tensors must match it): the copy
  // the output projection would make anyway.
  return std::make_tuple(heads.permute({2, 0, 1, 3}).contiguous().permute({1, 2, 0, 3}), weights);
}

// ------------------------------------------------------------------------------ CPU kernel
namespace {

// The block's scores are about this many bytes, so they stay in cache between the two GEMMs and
// the softmax: half of a core's L2 on the development machine (256 KiB was 1.4x slower at
// L = 2048: the scores GEMM is then too thin).
constexpr int64_t kBlockBytes = int64_t(1024) << 10;

// Rows per block: the buffer above, but at least 4 blocks a thread when the rows allow.
int64_t rows_per_block(int64_t N, int64_t L, int64_t S, int64_t element_size) {
  int64_t rows = std::clamp<int64_t>(kBlockBytes / (S * element_size), 8, 256);
  const int64_t wanted = 4 * at::get_num_threads();
  while (rows > 8 && N * ((L + rows - 1) / rows) < wanted) {
    rows /= 2;
  }
  return std::min(rows, L);
}

// The 2-D (rows, cols) view of row-major data at `data` with row stride `ld`.
Tensor matrix(void* data, int64_t rows, int64_t cols, int64_t ld, const at::TensorOptions& options) {
  return at::from_blob(data, {rows, cols}, {ld, 1}, options);
}

// One mask row of (n, h, l), or null; `ld` gets the stride between rows l (0: broadcast).
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

template <typename scalar_t>
void explicit_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                               bool average, const Tensor& heads_lnhd, const Tensor& weights) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const int64_t block = rows_per_block(N, L, S, sizeof(scalar_t));
  const int64_t blocks_per_sequence = (L + block - 1) / block;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  const auto options = q.options();
  scalar_t* weights_data = weights.data_ptr<scalar_t>();
  scalar_t* heads_data = heads_lnhd.data_ptr<scalar_t>();
  const int64_t heads_ld = N * H * D;  // (L, N, H, D): row l of head (n, h)

  at::parallel_for(0, N * blocks_per_sequence, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> buffer(average ? block * S : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks_per_sequence, l0 = (task % blocks_per_sequence) * block;
      const int64_t rows = std::min(block, L - l0);
      for (int64_t h = 0; h < H; ++h) {
        // With the average, a block's scores live in the buffer; per head, in the result itself.
        scalar_t* scores = average ? buffer.data() : weights_data + ((n * H + h) * L + l0) * S;
        Tensor scores_view = matrix(scores, rows, S, S, options);
        at::addmm_out(scores_view, scores_view, q[n][h].narrow(0, l0, rows), k[n][h].t(), /*beta=*/0, scale);
        int64_t mask_ld = 0;
        const scalar_t* mask_row = mask_rows<scalar_t>(mask, n, h, l0, &mask_ld);
        const kernel::SoftmaxRows<scalar_t> step{
            scores, S, mask_row, mask_ld, average ? weights_data + (n * L + l0) * S : nullptr, S, h == 0,
            static_cast<scalar_t>(h == H - 1 ? 1.0 / H : 1.0), rows, S};
        avx512 ? kernel::avx512::softmax_rows(step) : kernel::avx2::softmax_rows(step);
        Tensor heads_view = matrix(heads_data + (l0 * N + n) * H * D + h * D, rows, D, heads_ld, options);
        at::mm_out(heads_view, scores_view, v[n][h]);
      }
    }
  });
}

bool kernel_applies(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask) {
  const auto dtype = q.scalar_type();
  if (cpu_capability() == Capability::kNone || (dtype != at::kFloat && dtype != at::kDouble) ||
      k.scalar_type() != dtype || v.scalar_type() != dtype || q.numel() == 0 || k.size(2) == 0) {
    return false;
  }
  // The mask's rows are read in place: contiguous along the keys.
  return !is_present(mask) ||
      (mask->scalar_type() == dtype && mask->dim() == 4 && mask->size(3) == k.size(2) && mask->stride(3) == 1);
}

}  // namespace

std::tuple<Tensor, Tensor> attention_with_weights_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const OptionalTensor& mask, bool average) {
  if (!kernel_applies(q, k, v, mask)) {
    return attention_with_weights_reference(q, k, v, mask, average);
  }
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  // The heads are written in (L, N, H, D), the order the output projection reads them in.
  Tensor heads_lnhd = at::empty({L, N, H, D}, q.options());
  Tensor weights = at::empty(average ? std::vector<int64_t>{N, L, S} : std::vector<int64_t>{N, H, L, S}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_with_weights_cpu", [&] {
    explicit_attention_kernel<scalar_t>(q, k, v, mask, average, heads_lnhd, weights);
  });
  return std::make_tuple(heads_lnhd.permute({1, 2, 0, 3}), weights);
}

}  // namespace torchmha::core
