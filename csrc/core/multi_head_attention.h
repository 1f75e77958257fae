#pragma once

// The attention core: one forward of torch.nn.MultiheadAttention, as a pipeline of named steps
// validate -> (fused fast path) -> project -> extra key positions -> attend -> output projection.

#include "arguments.h"

#include <tuple>

namespace torchmha::core {

/// {output like query with last dim E_out, weights (N, L, S) averaged, (N, H, L, S), without N
/// for unbatched input, or undefined when call.need_weights is false}.
std::tuple<Tensor, Tensor> multi_head_attention(
    const ForwardCall& call,
    const AttentionWeights& weights,
    int64_t embed_dim);

}  // namespace torchmha::core
