// KeyValueCache (kv_cache.h).

#include <torchmha/kv_cache.h>

#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

namespace torchmha {

KeyValueCache::KeyValueCache(
    int64_t batch_size,
    int64_t num_heads,
    int64_t max_length,
    int64_t head_dim,
    at::TensorOptions options) {
  TORCH_CHECK_VALUE(
      batch_size > 0 && num_heads > 0 && max_length > 0 && head_dim > 0,
      "KeyValueCache sizes must be greater than 0, got batch_size=", batch_size, ", num_heads=", num_heads,
      ", max_length=", max_length, ", head_dim=", head_dim);
  keys_ = at::zeros({batch_size, num_heads, max_length, head_dim}, options);
  values_ = at::zeros_like(keys_);
}

void KeyValueCache::reset() {
  length_ = 0;
}

void KeyValueCache::reset(int64_t new_batch_size) {
  if (new_batch_size != batch_size()) {
    *this = KeyValueCache(new_batch_size, keys_.size(1), max_length(), keys_.size(3), keys_.options());
  }
  length_ = 0;
}

void KeyValueCache::advance(int64_t positions) {
  TORCH_CHECK_VALUE(
      positions >= 0 && length_ + positions <= max_length(), "KeyValueCache holds ", length_, " of its ",
      max_length(), " positions and cannot advance by ", positions);
  length_ += positions;
}

}  // namespace torchmha
