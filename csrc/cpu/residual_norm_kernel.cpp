// torchmha's CPU kernel of a decoding step's residual LayerNorm, layer_norm(x + y) (kernels.h):
// one call over up to 8 rows, where ATen's add and layer_norm cost more in dispatch and allocation
// (layer_norm makes three outputs) than in arithmetic. Measured through a one-layer CachedDecoder
// step (E=512, AMD EPYC Zen 5, 2 threads, alternated in one process against ATen's pair): 1.9-2.3
// us less a norm at batch 1 and at batch 8 in float32, 1.9 at batch 1 and none at batch 8 in
// bfloat16; a post-norm decoder step has three a layer.

#include "cpu/kernels.h"

#include "common/settings.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>

namespace torchmha::cpu {
namespace {

bool enabled() {
  static const bool on = settings::read_switch("TORCHMHA_RESIDUAL_NORM").value_or(true);
  return on;
}

// Rows up to which the kernel takes a call: the decoding steps it was measured on (1 and 8 rows).
// A prefill's many rows keep ATen's layer_norm, vectorized for the CPU and parallel.
constexpr int64_t kMaxRows = 8;

// Plain contiguous CPU tensors of x's dtype, at most kMaxRows rows, that the kernel reads through
// raw pointers.
bool kernel_applies(const Tensor& x, const Tensor& y, const OptionalTensor& weight, const OptionalTensor& bias) {
  const auto dtype = x.scalar_type();
  const auto per_feature = [&](const OptionalTensor& t) {
    return !is_present(t) || (t->device().is_cpu() && t->scalar_type() == dtype && t->dim() == 1 &&
                              t->size(0) == x.size(-1) && t->is_contiguous());
  };
  return enabled() && x.device().is_cpu() && y.device().is_cpu() &&
      (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && y.scalar_type() == dtype &&
      !x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && x.dim() >= 1 && x.size(-1) > 0 &&
      x.numel() / x.size(-1) <= kMaxRows && x.sizes() == y.sizes() && x.is_contiguous() && y.is_contiguous() &&
      per_feature(weight) && per_feature(bias);
}

// (eight running sums, so that the compiler can keep them in one vector register: a single chain
// of dependent adds is 4 cycles an element)
template <typename F>
float sum_of(int64_t E, const F& term) {
  float lanes[8] = {};
  int64_t e = 0;
  for (; e + 8 <= E; e += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += term(e + j);
  }
  for (; e < E; ++e) lanes[0] += term(e);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// `rows` rows of E features: h = x + y rounded to scalar_t (as torch's add gives it), then
// (h - mean) / sqrt(var + eps) * weight + bias in float, the variance from a second pass. h is
// held in the output row itself: already rounded to scalar_t, it reads back exactly (no buffer to
// allocate, on a path taken three times a layer each step).
template <typename scalar_t>
void norm_rows(const scalar_t* x, const scalar_t* y, const scalar_t* weight, const scalar_t* bias, scalar_t* out,
               int64_t E, float eps, int64_t rows) {
  for (int64_t row = 0; row < rows; ++row) {
    const scalar_t* xr = x + row * E;
    const scalar_t* yr = y + row * E;
    scalar_t* o = out + row * E;
    for (int64_t e = 0; e < E; ++e) {
      o[e] = static_cast<scalar_t>(static_cast<float>(xr[e]) + static_cast<float>(yr[e]));
    }
    const auto h = [o](int64_t e) { return static_cast<float>(o[e]); };
    const float mean = sum_of(E, h) / static_cast<float>(E);
    const float squares = sum_of(E, [&](int64_t e) { return (h(e) - mean) * (h(e) - mean); });
    const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(E) + eps);
    for (int64_t e = 0; e < E; ++e) {
      const float v = (h(e) - mean) * rstd;
      o[e] = static_cast<scalar_t>(v * (weight != nullptr ? static_cast<float>(weight[e]) : 1.0f) +
                                   (bias != nullptr ? static_cast<float>(bias[e]) : 0.0f));
    }
  }
}

}  // namespace

bool residual_layer_norm_into(const Tensor& x, const Tensor& y, const OptionalTensor& weight,
                              const OptionalTensor& bias, double eps, const Tensor& out) {
  if (!kernel_applies(x, y, weight, bias) || !out.is_contiguous() || out.scalar_type() != x.scalar_type() ||
      out.numel() != x.numel()) {
    return false;
  }
  const int64_t E = x.size(-1), rows = x.numel() / E;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "residual_layer_norm_cpu", [&] {
    const scalar_t* w = is_present(weight) ? weight->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* b = is_present(bias) ? bias->const_data_ptr<scalar_t>() : nullptr;
    norm_rows(x.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(), w, b, out.mutable_data_ptr<scalar_t>(), E,
              static_cast<float>(eps), rows);
  });
  return true;
}

std::optional<Tensor> residual_layer_norm(const Tensor& x, const Tensor& y, const OptionalTensor& weight,
                                          const OptionalTensor& bias, double eps) {
  if (!kernel_applies(x, y, weight, bias)) {
    return std::nullopt;
  }
  Tensor out = at::empty(x.sizes(), x.options());
  residual_layer_norm_into(x, y, weight, bias, eps, out);
  return out;
}

}  // namespace torchmha::cpu
