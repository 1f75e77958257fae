// Cached attention for decoding (cached_attention.h).

#include "cached_attention.h"

#include "attend.h"
#include "checks.h"
#include "in_projection.h"

#include <torchmha/errors.h>

namespace torchmha::core {
namespace {

// num_heads and the in-projection's width give the head size the keys must have.
int64_t checked_head_dim(const AttentionWeights& w) {
  const int64_t inner = w.in_proj.inner();
  check_positive_sizes(inner, w.num_heads);
  check_divisible(inner, w.num_heads);
  return inner / w.num_heads;
}

// A cache step projects keys and values from the query itself.
void check_self_attention_weights(const AttentionWeights& w, int64_t embed_dim) {
  if (w.in_proj.packed()) {
    return;
  }
  const auto& k = w.in_proj.weights[1];
  const auto& v = w.in_proj.weights[2];
  const int64_t kdim = is_present(k) ? k->size(-1) : embed_dim;
  const int64_t vdim = is_present(v) ? v->size(-1) : embed_dim;
  TORCH_CHECK(
      kdim == embed_dim && vdim == embed_dim, "MultiheadAttention.forward_with_cache with a KeyValueCache is "
      "self-attention, so it needs kdim == vdim == embed_dim (", embed_dim, "), but kdim is ", kdim, " and vdim ", vdim);
}

void check_cache(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const c10::SymInt& cache_length,
                 const AttentionWeights& w, const DecodingCall& call) {
  check_no_extra_key_positions(w, "forward_with_cache");
  check_batched(query, "query", "attention_with_cache");
  check_keys_values(query, k_cache, v_cache, call.batch_first, "attention_with_cache", "k_cache", "v_cache",
                    "; reset the cache for the new batch size");
  check_heads(k_cache, w.num_heads, checked_head_dim(w), "the cache");
  const int64_t embed_dim = query.size(-1);
  check_self_attention_weights(w, embed_dim);
  check_in_projection(w.in_proj, w.in_proj.inner(), embed_dim, embed_dim, embed_dim);
  // Else copy_ would convert the new keys into the cache and SDPA fail only after that write.
  for (const Tensor* cache : {&k_cache, &v_cache}) {
    TORCH_CHECK(
        cache->scalar_type() == query.scalar_type() && cache->device() == query.device(),
        "attention_with_cache: the cache must have query's dtype and device (", query.scalar_type(), ", ",
        query.device(), "), but got ", cache->scalar_type(), ", ", cache->device());
  }
  check_dropout(call.dropout_p);
  // cache_length grows every step; under torch.compile it is symbolic, and everything that
  // depends on it stays symbolic (sym checks, narrow_symint, arange) so that one graph serves
  // every step instead of one recompilation per length.
  const int64_t max_length = k_cache.size(2);
  const int64_t new_len = query.size(sequence_dim(call.batch_first));
  TORCH_CHECK_VALUE(
      cache_length.sym_ge(0).sym_and(cache_length.sym_le(max_length)).expect_true(__FILE__, __LINE__),
      "cache_length must be in [0, ", max_length, "], but got ", cache_length);
  TORCH_SYM_CHECK(
      (cache_length + new_len).sym_le(max_length), "the key/value cache is full: it holds ", cache_length, " of its ",
      max_length, " positions and cannot take ", new_len, " more; make it with a larger max_length or reset() it");
}

// The caller's key_padding_mask (N, S) as an additive (N, 1, 1, S) mask in the query's dtype.
OptionalTensor checked_padding(const OptionalTensor& kpm, const Tensor& query, const c10::SymInt& src_len,
                               bool batch_first) {
  if (!is_present(kpm)) {
    return std::nullopt;
  }
  const int64_t batch = query.size(batch_dim(batch_first));
  check_mask_kind(kpm, "key_padding_mask");
  check_padding_mask_shape(*kpm, batch, src_len, /*batched=*/true);
  auto padding = padding_bias(kpm, batch, src_len, query.scalar_type());
  check_mask_dtype(padding, query.scalar_type());
  return padding;
}

}  // namespace

Tensor attention_with_cache(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                            const c10::SymInt& cache_length, const AttentionWeights& w, const DecodingCall& call) {
  // validate; the masks too, before the caches are written, so a bad call leaves them as they were
  check_cache(query, k_cache, v_cache, cache_length, w, call);
  const int64_t new_len = query.size(sequence_dim(call.batch_first));
  const c10::SymInt src_len = cache_length + new_len;
  // Query i sits at absolute position cache_length + i. (SDPA's is_causal would align the
  // triangle top-left when new_len != src_len: wrong here.)
  auto mask = add_masks(causal_bias(new_len, cache_length, src_len, query.options()),
                        checked_padding(call.key_padding_mask, query, src_len, call.batch_first));

  // project: one packed GEMM for q|k|v of the new positions
  auto [q, k, v] = project_to_heads(query, query, query, w.in_proj, Sharing::kSelfAttention, w.num_heads,
                                    call.batch_first);
  // write the cache
  k_cache.narrow_symint(2, cache_length, new_len).copy_(k);
  v_cache.narrow_symint(2, cache_length, new_len).copy_(v);
  // attend, output projection
  auto heads = attend(q, k_cache.narrow_symint(2, 0, src_len), v_cache.narrow_symint(2, 0, src_len), mask,
                      call.effective_dropout());
  return project_output(heads, w, call.batch_first);
}

std::tuple<Tensor, Tensor> project_key_value(const Tensor& key, const Tensor& value, const AttentionWeights& w,
                                             bool batch_first) {
  check_no_extra_key_positions(w, "project_key_value");
  checked_head_dim(w);
  check_batched(key, "key", "project_key_value");
  check_batched(value, "value", "project_key_value");
  check_key_value_shapes(key, value, /*separate_weights=*/true, batch_first);
  check_in_projection(w.in_proj, w.in_proj.inner(), -1, key.size(-1), value.size(-1));
  auto heads = project_to_heads(Tensor(), key, value, w.in_proj, sharing_of(Tensor(), key, value), w.num_heads,
                                batch_first);
  // Contiguous once here, so every decoding step reads them without a copy.
  return std::make_tuple(heads[1].contiguous(), heads[2].contiguous());
}

Tensor attention_with_static_key_value(const Tensor& query, const Tensor& keys, const Tensor& values,
                                       const AttentionWeights& w, const DecodingCall& call) {
  const char* function = "attention_with_static_key_value";
  check_no_extra_key_positions(w, "forward_with_cache");
  check_batched(query, "query", function);
  check_keys_values(query, keys, values, call.batch_first, function, "keys", "values",
                    " (project the context again for this batch)");
  check_heads(keys, w.num_heads, checked_head_dim(w), "the projected memory");
  check_in_projection(w.in_proj, w.in_proj.inner(), query.size(-1), -1, -1);
  check_dropout(call.dropout_p);
  auto mask = checked_padding(call.key_padding_mask, query, keys.size(2), call.batch_first);
  auto heads = project_to_heads(query, Tensor(), Tensor(), w.in_proj, Sharing::kSeparate, w.num_heads,
                                call.batch_first);
  return project_output(attend(heads[0], keys, values, mask, call.effective_dropout()), w,
                        call.batch_first);
}

}  // namespace torchmha::core
