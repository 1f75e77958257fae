#pragma once

// Cached attention for decoding, on the same steps as the attention core: validate -> project
// (one packed GEMM for the new positions) -> write the cache -> attend (SDPA) -> output projection.

#include "arguments.h"

#include <c10/core/SymInt.h>

#include <tuple>

namespace torchmha::core {

/// Options of a decoding call (the module's dropout and mode, and the query's layout).
struct DecodingCall {
  OptionalTensor key_padding_mask;
  double dropout_p = 0.0;
  bool training = false;
  bool batch_first = false;

  double effective_dropout() const { return training ? dropout_p : 0.0; }
};

/// One step of causal self-attention: the new positions' keys and values are written into the
/// caches (N, H, M, D) at [cache_length, cache_length + T), and query i sees keys 0 ..
/// cache_length + i. cache_length may be symbolic (torch.compile), and stays so.
Tensor attention_with_cache(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                            const c10::SymInt& cache_length, const AttentionWeights& weights,
                            const DecodingCall& call);

/// A fixed memory's keys and values, projected once: {keys, values}, (N, H, S, D) each, contiguous.
std::tuple<Tensor, Tensor> project_key_value(const Tensor& key, const Tensor& value, const AttentionWeights& weights,
                                             bool batch_first);

/// Attention of query to keys and values from project_key_value (no causal mask).
Tensor attention_with_static_key_value(const Tensor& query, const Tensor& keys, const Tensor& values,
                                       const AttentionWeights& weights, const DecodingCall& call);

}  // namespace torchmha::core
