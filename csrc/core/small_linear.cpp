// The linear layers of a decoding step (small_linear.h): the op's front; the CPU kernel is
// csrc/cpu/small_linear_kernel.cpp.

#include "small_linear.h"

#include "cpu/kernels.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace torchmha::core {
namespace {

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


}  // namespace

Tensor linear_layer(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  // (symbolic shapes, under torch.compile(dynamic=True): the op is for a step's fixed few rows)
  if (!x.device().is_cpu() || needs_grad(x, weight, bias) || x.dim() == 0 ||
      x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || x.size(-1) == 0 || x.numel() == 0 ||
      !cpu::small_linear_serves(x.numel() / x.size(-1))) {
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
  if (auto y = cpu::small_linear(x, weight, bias)) {
    return *std::move(y);
  }
  return at::linear(x, weight, bias);
}

}  // namespace torchmha::core
