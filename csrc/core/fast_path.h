#pragma once

// The fused fast path: torch.nn.MultiheadAttention's conditions for
// torch._native_multi_head_attention (its fused inference kernel), and the call itself.

#include "arguments.h"
#include "checks.h"

#include <torchmha/export.h>
#include <torchmha/functional.h>

#include <optional>
#include <string>
#include <tuple>

namespace torchmha::core {

/// Overrides set_fast_path_enabled() on this thread while it lives: torchmha._C's bound C++
/// modules follow Python's torch.backends.mha switch with it. (Exported for torchmha._C.)
class TORCHMHA_API FastPathOverride {
 public:
  explicit FastPathOverride(bool enabled);
  ~FastPathOverride();
  FastPathOverride(const FastPathOverride&) = delete;
  FastPathOverride& operator=(const FastPathOverride&) = delete;

 private:
  std::optional<bool> previous_;
};

/// Why torch's module forward would not take its fused path, in torch's words and order (empty:
/// it would). `allowed` folds in what only Python sees: the fast-path switch and tracing.
std::string why_not_fast_path(const ForwardCall& call, const AttentionWeights& weights, bool allowed);
/// Where torch would take the fused path but SDPA gives the same numbers faster (then the output
/// keeps the fused kernel's contiguous layout).
bool sdpa_beats_fast_path(const ForwardCall& call);
/// Where torch would take the fused path with weights, and torchmha's explicit-weights CPU kernel
/// (explicit_attention.h) gives the same numbers faster: the slow path then runs it. Only for
/// well-formed calls, so that every fault is still the fused kernel's own.
bool weights_kernel_beats_fast_path(const ForwardCall& call, int64_t embed_dim, int64_t num_heads);
/// The one fault the fused kernel would report for such a call (query, key and value are one
/// batched tensor of the module's dtype, no masks), with the kernel's message.
void check_fused_embedding(const ForwardCall& call, int64_t embed_dim);

/// The fused kernel on the masks merged as torch's merge_masks does; torch's checks are the
/// kernel's own.
std::tuple<Tensor, Tensor> fused_forward(const ForwardCall& call, const AttentionWeights& weights, int64_t embed_dim);

}  // namespace torchmha::core
