#pragma once

// Private to libtorchmha (not installed): the memory order of the attention kernels' output heads,
// shared by the CPU kernels, which write it, and the ops' references, whose fake tensors must match
// it. The heads are (N, H, L, D) in shape and laid out in the order the output projection reads
// them, so that merging them is a view, not a copy: (L, N, H, D) for torch's (L, N, E) output,
// or (N, L, H, D), "batch-major", for the (N, L, E) output of batch_first's fused path.

#include <ATen/ATen.h>

#include <cstdint>

namespace torchmha {

/// Uninitialized heads of shape (N, H, L, D) in that order.
inline at::Tensor empty_heads(int64_t N, int64_t H, int64_t L, int64_t D, const at::TensorOptions& options,
                              bool batch_major) {
  return batch_major ? at::empty({N, L, H, D}, options).transpose(1, 2)
                     : at::empty({L, N, H, D}, options).permute({1, 2, 0, 3});
}

/// (N, H, L, D) heads copied into that order.
inline at::Tensor heads_laid_out(const at::Tensor& heads, bool batch_major) {
  at::Tensor out = empty_heads(heads.size(0), heads.size(1), heads.size(2), heads.size(3), heads.options(),
                               batch_major);
  return out.copy_(heads);
}

}  // namespace torchmha
