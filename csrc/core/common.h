#pragma once

// Private to libtorchmha (not installed): the core's vocabulary. An absent tensor is
// std::optional<at::Tensor> everywhere in the core, as in the op schemas ("Tensor?") and in
// at::linear / at::scaled_dot_product_attention, so it is never converted on the way through.
// LibTorch modules hold an absent parameter as an undefined tensor; they convert once, when
// they call the core (optional_if_defined).

#include <ATen/core/Tensor.h>
#include <c10/util/StringUtil.h>

#include <optional>
#include <string>

namespace torchmha::core {

using at::Tensor;
using OptionalTensor = std::optional<at::Tensor>;

inline bool is_present(const OptionalTensor& t) {
  return t.has_value() && t->defined();
}

inline OptionalTensor optional_if_defined(const Tensor& t) {
  return t.defined() ? OptionalTensor(t) : std::nullopt;
}

// Query, key and value layouts: (len, N, E), or (N, len, E) with batch_first.
inline int64_t batch_dim(bool batch_first) {
  return batch_first ? 0 : 1;
}
inline int64_t sequence_dim(bool batch_first) {
  return batch_first ? 1 : 0;
}

// Python's spelling of a shape (torch.Size([2, 3])): where a check is torch's, its message is
// torch's, word for word, so a regex or warning filter written against torch matches it.
template <typename Sizes>
std::string torch_size(const Sizes& sizes) {
  return c10::str("torch.Size(", sizes, ")");
}

}  // namespace torchmha::core
