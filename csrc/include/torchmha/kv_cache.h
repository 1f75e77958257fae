#pragma once

// Caches for incremental decoding. Shapes: N batch, H heads, D head_dim, M capacity, S context
// length. MultiheadAttention::forward_with_cache and CrossAttention::forward_with_cache use them.

#include <torchmha/export.h>

#include <ATen/core/Tensor.h>

namespace torchmha {

/// Keys and values of a fixed context (an encoder output), projected once and reused on every
/// decoding step (the cross-attention cache). keys, values: (N, H, S, D).
struct StaticKeyValue {
  at::Tensor keys;
  at::Tensor values;
};

/// A preallocated self-attention key/value cache: keys and values (N, H, max_length, D), and
/// lengths() (N,) int64, the positions filled per sequence. Each decoding step appends in place;
/// sequences may be at different positions.
/// ```
/// auto cache = torchmha::KeyValueCache::for_module(*mha, /*batch_size=*/4, /*max_length=*/1024);
/// auto y = mha->forward_with_cache(prompts, cache, prompt_lengths);  // prefill, mixed lengths
/// for (...) { y = mha->forward_with_cache(x_t, cache); }              // one position each
/// cache.reorder(beams);                                                // beam search
/// cache.reset(finished);                                               // new requests in those slots
/// ```
class TORCHMHA_API KeyValueCache {
 public:
  KeyValueCache(
      int64_t batch_size,
      int64_t num_heads,
      int64_t max_length,
      int64_t head_dim,
      at::TensorOptions options = at::TensorOptions());
  /// A cache for `attention` (a MultiheadAttentionImpl): its heads and head_dim, and the dtype
  /// and device of its out_proj weight (present in every configuration).
  template <typename Attention>
  static KeyValueCache for_module(const Attention& attention, int64_t batch_size, int64_t max_length) {
    return KeyValueCache(
        batch_size, attention.options.num_heads(), max_length, attention.head_dim, attention.out_proj->weight.options());
  }

  /// Empties every sequence (keeps the storage).
  void reset();
  /// Empties the sequences `slots` (an integer index or a bool mask); the others go on.
  void reset(const at::Tensor& slots);
  /// Empties every sequence and makes room for batches of `batch_size` (reallocates only if the
  /// batch size changes).
  void reset(int64_t batch_size);
  /// Beam search: sequence i becomes old sequence indices[i], with its length.
  void reorder(const at::Tensor& indices);

  const at::Tensor& keys() const { return keys_; }
  const at::Tensor& values() const { return values_; }
  /// Positions filled per sequence, (N,) int64 (the decoding op updates it in place).
  const at::Tensor& lengths() const { return lengths_; }
  /// Positions filled, while every sequence has the same length; throws when they differ.
  int64_t length() const;
  int64_t batch_size() const { return keys_.size(0); }
  int64_t max_length() const { return keys_.size(2); }

 private:
  at::Tensor keys_, values_, lengths_;
};

}  // namespace torchmha
