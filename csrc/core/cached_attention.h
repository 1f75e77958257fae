#pragma once

// Cached attention for decoding, on the same steps as the attention core: validate -> project
// (one packed GEMM for the new positions) -> write the cache and attend (decode_attention) -> output
// projection.

#include "arguments.h"

#include <c10/core/SymInt.h>

#include <optional>
#include <tuple>

namespace torchmha::core {

/// Options of a decoding call (the module's dropout and mode, and the query's layout).
using DecodingCall = DecodingOptions;  // (attention_arguments.h)

/// One step of causal self-attention, each sequence at its own position (functional.h's
/// attention_with_cache): sequence n's first new_lengths[n] new positions (all T if absent) are
/// written into the caches (N, H, M, D) at lengths[n], attend to its own prefix, and lengths[n]
/// grows by as many, in place.
Tensor attention_with_cache(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                            const OptionalTensor& new_lengths, const AttentionWeights& weights,
                            const DecodingCall& call);

/// `output` (T, N, E) (batch_first: (N, T, E)) with rows past new_lengths[n] zeroed (as is, if absent).
Tensor zero_rows_past(const Tensor& output, const OptionalTensor& new_lengths, bool batch_first);

/// Beam search's indices ((N,) integers, N = lengths' size) as an int64 index on lengths' device;
/// `who` names the caller in the error.
Tensor checked_reorder_index(const Tensor& indices, const Tensor& lengths, const char* who);
/// Beam search on one cache tensor: along batch_dim, row i becomes old row index[i], over the
/// first `filled` positions along position_dim (all if nullopt; see filled_length), in place.
void reorder_rows(const Tensor& cache, int64_t batch_dim, int64_t position_dim, const Tensor& index,
                  std::optional<int64_t> filled);
/// Beam search: sequence i of the cache becomes old sequence indices[i], with its length (in place).
void reorder_cache(const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths, const Tensor& indices);
/// Empties the sequences `slots` (an index or a bool mask; all if absent): their lengths become 0.
void reset_cache(const Tensor& lengths, const OptionalTensor& slots);

/// A fixed memory's keys and values, projected once: {keys, values}, (N, H, S, D) each, contiguous.
std::tuple<Tensor, Tensor> project_key_value(const Tensor& key, const Tensor& value, const AttentionWeights& weights,
                                             bool batch_first);
/// The same, checked and projected, as strided views of the projection's output (for a caller
/// that copies them once into a buffer of its own).
std::tuple<Tensor, Tensor> key_value_heads(const Tensor& key, const Tensor& value, const AttentionWeights& weights,
                                           bool batch_first);

/// Attention of query to keys and values from project_key_value (no causal mask).
Tensor attention_with_static_key_value(const Tensor& query, const Tensor& keys, const Tensor& values,
                                       const AttentionWeights& weights, const DecodingCall& call);

}  // namespace torchmha::core
