#pragma once

// The source article's layers (docs/versions.md) on the attention core: CrossAttention's and TransformerBlock's
// forward computations (the modules in csrc/modules own their parameters and call these).

#include "arguments.h"
#include "cached_attention.h"

#include <torchmha/export.h>

namespace torchmha::core {

/// Attention of x (N, L, query_dim) to a projected context; mask (N, S) bool, true = keep (the
/// article's convention, the opposite of key_padding_mask).
Tensor cross_attention(const Tensor& x, const Tensor& keys, const Tensor& values, const AttentionWeights& weights,
                       const OptionalTensor& mask, bool training);

using FeedForwardWeights = FeedForwardParameters;  // (attention_arguments.h)

/// torch.nn.TransformerEncoderLayer's computation (relu, batch first), post-norm or ff.norm_first;
/// call.query is x and call.dropout_p the self-attention's dropout (on its weights).
Tensor transformer_block(const ForwardCall& call, const AttentionWeights& attention, const FeedForwardWeights& ff);

/// Sizes checked by the modules' constructors, C++ and Python (exported for torchmha._C).
TORCHMHA_API void check_cross_attention_sizes(int64_t query_dim, int64_t context_dim, int64_t heads,
                                              int64_t dim_head);
TORCHMHA_API void check_forward_expansion(int64_t forward_expansion);

}  // namespace torchmha::core
