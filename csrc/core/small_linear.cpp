// The linear layers of a decoding step (small_linear.h): the op's front; the CPU kernel is
// csrc/cpu/small_linear_kernel.cpp.

#include "small_linear.h"

#include "cpu/cpu_capability.h"
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


// at::linear, computed in float32 and rounded once where torch's own bfloat16/float16 GEMM is
// slower on this CPU (cpu::reduced_gemm_in_float32).
Tensor gemm_linear(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  const auto dtype = x.scalar_type();
  if (x.device().is_cpu() && weight.scalar_type() == dtype && (!is_present(bias) || bias->scalar_type() == dtype) &&
      cpu::reduced_gemm_in_float32(dtype)) {
    const OptionalTensor float_bias = is_present(bias) ? OptionalTensor(bias->to(at::kFloat)) : std::nullopt;
    return at::linear(x.to(at::kFloat), weight.to(at::kFloat), float_bias).to(dtype);
  }
  return at::linear(x, weight, bias);
}

// A dispatcher op, found once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

Tensor linear_layer(const Tensor& x, const Tensor& weight, const OptionalTensor& bias, const OptionalTensor& scale) {
  if (is_present(scale)) {
    // (the op has no autograd formula; the reference is differentiable in x)
    if (needs_grad(x, weight, bias)) {
      return quantized_linear_reference(x, weight, *scale, bias);
    }
    static auto op = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&)>(
        "torchmha::quantized_linear");
    return op.call(x, weight, *scale, bias);
  }
  // (symbolic shapes, under torch.compile(dynamic=True): the op is for a step's fixed few rows)
  if (!x.device().is_cpu() || needs_grad(x, weight, bias) || x.dim() == 0 ||
      x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || x.size(-1) == 0 || x.numel() == 0 ||
      !cpu::small_linear_serves(x, weight)) {
    return gemm_linear(x, weight, bias);
  }
  static auto op = find_op<Tensor(const Tensor&, const Tensor&, const OptionalTensor&)>("torchmha::small_linear");
  return op.call(x, weight, bias);
}

Tensor small_linear_reference(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  return at::linear(x, weight, bias);
}

Tensor small_linear_cpu(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  if (auto y = cpu::small_linear(x, weight, bias)) {
    return *std::move(y);
  }
  return gemm_linear(x, weight, bias);
}

std::tuple<Tensor, Tensor> quantize_weight(const Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && at::isFloatingType(weight.scalar_type()),
                    "quantize_weight: expected a 2-D floating weight (out_features, in_features), but got ",
                    weight.scalar_type(), " of shape ", weight.sizes());
  const Tensor w = weight.detach().to(at::kFloat);
  Tensor scale = w.abs().amax(1).div_(127);
  scale.masked_fill_(scale == 0, 1);  // an all-zero row: any scale gives zeros
  const Tensor q = w.div(scale.unsqueeze(1)).round_().clamp_(-127, 127).to(at::kChar);
  return {q.contiguous(), scale.contiguous()};
}

Tensor quantized_linear_reference(const Tensor& x, const Tensor& weight, const Tensor& scale,
                                  const OptionalTensor& bias) {
  check_weight_scale(weight, scale, "quantized_linear");
  // weight * scale exactly in float64, rounded once to float32 otherwise (one pass: the int8
  // weight promotes to the scale's dtype); then x's linear as any other past the kernel
  // (gemm_linear: float32 where torch's own GEMM in x's dtype is slow here)
  const auto exact = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor dequantized = at::mul(weight, scale.to(exact).unsqueeze(1)).to(x.scalar_type());
  return gemm_linear(x, dequantized, bias);
}

Tensor quantized_linear_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale, const OptionalTensor& bias) {
  if (auto y = cpu::quantized_linear(x, weight, scale, bias)) {
    return *std::move(y);
  }
  return quantized_linear_reference(x, weight, scale, bias);
}

}  // namespace torchmha::core
