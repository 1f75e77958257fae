#pragma once

// The fused fast path: torch.nn.MultiheadAttention's conditions for
// torch._native_multi_head_attention (its fused inference kernel), and the call itself.

#include "arguments.h"
#include "checks.h"

#include <torchmha/export.h>
#include <torchmha/functional.h>

#include <optional>

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

/// torch's conditions for its fused path, less those only Python can see (the fast-path switch,
/// tracing), which the caller folds into allow_fast_path.
bool torch_takes_fast_path(const ForwardCall& call, const AttentionWeights& weights);
/// Where torch would take the fused path but SDPA gives the same numbers faster (then the output
/// keeps the fused kernel's contiguous layout).
bool sdpa_beats_fast_path(const ForwardCall& call);

/// The fused kernel on masks merged as torch's merge_masks does. Masks are additive already.
std::tuple<Tensor, Tensor> fused_forward(
    const ForwardCall& call,
    const AttentionWeights& weights,
    const Geometry& g,
    int64_t embed_dim,
    const OptionalTensor& attn_mask,
    const OptionalTensor& padding_mask);

}  // namespace torchmha::core
