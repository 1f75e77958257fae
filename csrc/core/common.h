#pragma once

// Private to libtorchmha (not installed): the core's vocabulary. An absent tensor is an
// OptionalTensor (common/optional_tensor.h, shared with the CPU kernels) everywhere in the core.

#include "common/optional_tensor.h"

#include <ATen/core/Tensor.h>
#include <c10/util/StringUtil.h>

#include <string>

namespace torchmha::core {

using at::Tensor;  // (OptionalTensor, is_present, optional_if_defined: torchmha's, found from here)

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
