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

/// A preallocated self-attention key/value cache: keys and values (N, H, max_length, D), of
/// which the first length() positions are filled. Each decoding step appends in place.
/// ```
/// auto cache = torchmha::KeyValueCache::for_module(*mha, /*batch_size=*/1, /*max_length=*/1024);
/// for (...) { auto y = mha->forward_with_cache(x_t, cache); }   // x_t: one new position
/// cache.reset();                                                 // next sequence, same batch
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

  /// Forgets the cached positions (keeps the storage).
  void reset();
  /// Forgets the cached positions and makes room for batches of `batch_size` (reallocates only if
  /// the batch size changes).
  void reset(int64_t batch_size);
  /// Counts `positions` more as filled: attention_with_cache wrote them (forward_with_cache calls this).
  void advance(int64_t positions);

  const at::Tensor& keys() const { return keys_; }
  const at::Tensor& values() const { return values_; }
  /// Positions filled so far.
  int64_t length() const { return length_; }
  int64_t batch_size() const { return keys_.size(0); }
  int64_t max_length() const { return keys_.size(2); }

 private:
  at::Tensor keys_, values_;
  int64_t length_ = 0;
};

}  // namespace torchmha
