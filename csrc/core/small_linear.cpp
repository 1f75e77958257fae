// The small-batch linear op (small_linear.h).

#include "small_linear.h"

#include "cpu_capability.h"
#include "linear_kernel.h"
#include "settings.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <type_traits>

namespace torchmha::core {
namespace {

bool enabled() {
  static const bool on = settings::read_switch("TORCHMHA_SMALL_LINEAR").value_or(true);
  return on;
}

// Whether a derivative is asked of this call: backward (autograd) or forward (dual tensors), or
// through torch.func's transforms (wrapped tensors): the op has no formula for either.
bool needs_grad(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  const auto transformed = c10::DispatchKeySet({c10::DispatchKey::FuncTorchGradWrapper,
                                                c10::DispatchKey::FuncTorchBatched});
  for (const Tensor* t : {&x, &weight, is_present(bias) ? &*bias : &x}) {
    if ((at::GradMode::is_enabled() && t->requires_grad()) || t->_fw_grad(/*level=*/0).defined() ||
        !(t->key_set() & transformed).empty()) {
      return true;
    }
  }
  return false;
}

// Shapes, dtypes and strides the kernel reads through raw pointers.
bool kernel_applies(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  const auto dtype = x.scalar_type();
  if (!enabled() || cpu_capability() == Capability::kNone || !x.device().is_cpu() ||
      (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) || weight.scalar_type() != dtype ||
      x.dim() < 1 || weight.dim() != 2 || x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      weight.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const int64_t K = x.size(-1);
  const int64_t rows = K > 0 ? x.numel() / K : 0;
  return K > 0 && weight.size(1) == K && weight.size(0) > 0 && rows >= 1 && rows <= kernel::kLinearMaxRows &&
      weight.stride(1) == 1 && weight.stride(0) >= K &&
      (!is_present(bias) || (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                             bias->stride(0) == 1));
}

template <typename scalar_t>
void run_kernel(const Tensor& x, const Tensor& weight, const OptionalTensor& bias, const Tensor& y) {
  const int64_t K = x.size(-1), O = weight.size(0);
  const Tensor rows = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const kernel::LinearProblem<scalar_t> problem{
      rows.data_ptr<float>(), weight.data_ptr<scalar_t>(), weight.stride(0),
      is_present(bias) ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), rows.size(0), K, O};
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  // Tasks of at least 64 KiB of weights: below that, waking a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(8, 65536 / (K * static_cast<int64_t>(sizeof(scalar_t))));
  at::parallel_for(0, O, grain, [&](int64_t begin, int64_t end) {
    avx512 ? kernel::avx512::linear_rows(problem, begin, end) : kernel::avx2::linear_rows(problem, begin, end);
  });
}

}  // namespace

Tensor linear_layer(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  // (symbolic shapes, under torch.compile(dynamic=True): the op is for a step's fixed few rows)
  if (!x.device().is_cpu() || needs_grad(x, weight, bias) || !enabled() || x.dim() == 0 ||
      x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || x.size(-1) == 0 || x.numel() == 0 ||
      x.numel() / x.size(-1) > kernel::kLinearMaxRows) {
    return at::linear(x, weight, bias);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchmha::small_linear", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const OptionalTensor&)>();
  return op.call(x, weight, bias);
}

Tensor small_linear_reference(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  return at::linear(x, weight, bias);
}

Tensor small_linear_cpu(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  if (!kernel_applies(x, weight, bias)) {
    return at::linear(x, weight, bias);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  Tensor y = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_linear_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      run_kernel<scalar_t>(x, weight, bias, y);
    }
  });
  return y;
}

}  // namespace torchmha::core
