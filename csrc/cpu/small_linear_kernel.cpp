// torchmha's CPU kernel of the linear layers of a decoding step: each weight row read once, front
// to back, at the read rate (kernels.h; the op's front is csrc/core/small_linear.cpp).

#include "cpu/kernels.h"

#include "common/settings.h"
#include "cpu/cpu_capability.h"
#include "cpu/vec/linear_kernel.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

namespace torchmha::cpu {
namespace {

bool enabled() {
  static const bool on = settings::read_switch("TORCHMHA_SMALL_LINEAR").value_or(true);
  return on;
}

// Shapes, dtypes and strides the kernel reads through raw pointers: W in x's dtype, or int8 with a
// float32 scale per row.
bool kernel_applies(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias) {
  const auto dtype = x.scalar_type();
  const auto weight_dtype = is_present(scale) ? at::kChar : dtype;
  if (!enabled() || cpu_capability() == Capability::kNone || !x.device().is_cpu() || !weight.device().is_cpu() ||
      (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) || weight.scalar_type() != weight_dtype ||
      x.dim() < 1 || weight.dim() != 2 || x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      weight.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const int64_t K = x.size(-1);
  const int64_t rows = K > 0 ? x.numel() / K : 0;
  const auto per_row = [&](const Tensor& t, at::ScalarType type) {
    return t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.size(0) == weight.size(0) &&
        t.stride(0) == 1;
  };
  return K > 0 && weight.size(1) == K && weight.size(0) > 0 && rows >= 1 && rows <= kernel::kLinearMaxRows &&
      weight.stride(1) == 1 && weight.stride(0) >= K && (!is_present(scale) || per_row(*scale, at::kFloat)) &&
      (!is_present(bias) || per_row(*bias, dtype));
}

template <typename scalar_t, typename weight_t>
void run_kernel(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias,
                const Tensor& y) {
  const int64_t K = x.size(-1), O = weight.size(0);
  const Tensor rows = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const kernel::LinearProblem<scalar_t, weight_t> problem{
      rows.data_ptr<float>(), weight.data_ptr<weight_t>(), weight.stride(0),
      is_present(scale) ? scale->data_ptr<float>() : nullptr, is_present(bias) ? bias->data_ptr<scalar_t>() : nullptr,
      y.data_ptr<scalar_t>(), rows.size(0), K, O};
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  // Tasks of at least 64 KiB of weights: below that, waking a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(8, 65536 / (K * static_cast<int64_t>(sizeof(weight_t))));
  at::parallel_for(0, O, grain, [&](int64_t begin, int64_t end) {
    avx512 ? kernel::avx512::linear_rows(problem, begin, end) : kernel::avx2::linear_rows(problem, begin, end);
  });
}

std::optional<Tensor> run(const Tensor& x, const Tensor& weight, const OptionalTensor& scale,
                          const OptionalTensor& bias) {
  if (!kernel_applies(x, weight, scale, bias)) {
    return std::nullopt;
  }
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  Tensor y = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_linear_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      is_present(scale) ? run_kernel<scalar_t, int8_t>(x, weight, scale, bias, y)
                        : run_kernel<scalar_t, scalar_t>(x, weight, scale, bias, y);
    }
  });
  return y;
}

}  // namespace

bool small_linear_serves(int64_t rows) {
  return enabled() && rows <= kernel::kLinearMaxRows;
}

std::optional<Tensor> small_linear(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  return run(x, weight, std::nullopt, bias);
}

std::optional<Tensor> quantized_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                                       const OptionalTensor& bias) {
  return run(x, weight, scale, bias);
}

}  // namespace torchmha::cpu
