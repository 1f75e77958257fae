// KeyValueCache (kv_cache.h).

#include <torchmha/kv_cache.h>

#include <torchmha/functional.h>

#include <ATen/ops/aminmax.h>
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
  lengths_ = at::zeros({batch_size}, keys_.options().dtype(at::kLong));
}

void KeyValueCache::reset() {
  reset_cache(lengths_);
}

void KeyValueCache::reset(const at::Tensor& slots) {
  reset_cache(lengths_, slots);
}

void KeyValueCache::reset(int64_t new_batch_size) {
  if (new_batch_size != batch_size()) {
    *this = KeyValueCache(new_batch_size, keys_.size(1), max_length(), keys_.size(3), keys_.options());
  }
  reset();
}

void KeyValueCache::reorder(const at::Tensor& indices) {
  reorder_cache(keys_, values_, lengths_, indices);
}

int64_t KeyValueCache::length() const {
  const auto [shortest, longest] = at::aminmax(lengths_);
  const int64_t lo = shortest.item<int64_t>(), hi = longest.item<int64_t>();
  TORCH_CHECK(lo == hi, "KeyValueCache.length: the sequences have different lengths (from ", lo, " to ", hi,
              "); use lengths");
  return hi;
}

}  // namespace torchmha
