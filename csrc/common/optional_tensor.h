#pragma once

// Private to libtorchmha (not installed): the one form of an absent tensor, shared by the core and
// the CPU kernels. It is std::optional<at::Tensor> everywhere, as in the op schemas ("Tensor?") and
// in at::linear / at::scaled_dot_product_attention, so it is never converted on the way through.
// LibTorch modules hold an absent parameter as an undefined tensor; they convert once, when they
// call the core (optional_if_defined).

#include <ATen/core/Tensor.h>

#include <optional>

namespace torchmha {

using OptionalTensor = std::optional<at::Tensor>;

inline bool is_present(const OptionalTensor& t) {
  return t.has_value() && t->defined();
}

inline OptionalTensor optional_if_defined(const at::Tensor& t) {
  return t.defined() ? OptionalTensor(t) : std::nullopt;
}

}  // namespace torchmha
