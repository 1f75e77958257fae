// Cached attention for decoding (cached_attention.h).

#include "cached_attention.h"

#include "attend.h"
#include "checks.h"
#include "decode_attention.h"
#include "in_projection.h"

#include <torchmha/errors.h>

#include <ATen/ATen.h>  // the ops and the tensor operators (<, &, +) on index tensors

namespace torchmha::core {
namespace {

// num_heads and the in-projection's width give the head size the keys must have.
int64_t checked_head_dim(const AttentionWeights& w) {
  const int64_t inner = w.in_proj.inner();
  check_positive_sizes(inner, w.num_heads);
  check_divisible(inner, w.num_heads);
  TORCHMHA_CHECK_ARG(!w.head_dim || *w.head_dim * w.num_heads == inner, "head_dim ", w.head_dim.value_or(0),
                     " times num_heads ", w.num_heads, " is not the in-projection's width ", inner);
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

void check_cache(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                 const AttentionWeights& w, const DecodingCall& call) {
  check_no_extra_key_positions(w, "forward_with_cache");
  check_batched(query, "query", "attention_with_cache");
  check_keys_values(query, k_cache, v_cache, call.batch_first, "attention_with_cache", "k_cache", "v_cache",
                    "; reset the cache for the new batch size");
  check_heads(k_cache, w.num_heads, checked_head_dim(w), "the cache");
  const int64_t embed_dim = query.size(-1);
  check_self_attention_weights(w, embed_dim);
  check_in_projection(w.in_proj, w.in_proj.inner(), embed_dim, embed_dim, embed_dim);
  // Else the new keys would be converted into the cache, and attention fail only after that write.
  for (const Tensor* cache : {&k_cache, &v_cache}) {
    TORCH_CHECK(
        cache->scalar_type() == query.scalar_type() && cache->device() == query.device(),
        "attention_with_cache: the cache must have query's dtype and device (", query.scalar_type(), ", ",
        query.device(), "), but got ", cache->scalar_type(), ", ", cache->device());
  }
  check_dropout(call.dropout_p);
}

// lengths, new_lengths: (N,) int64 on the query's device. (Their values are checked by the
// attention kernel, which reads them anyway, before it writes anything.)
void check_lengths(const Tensor& lengths, const char* name, int64_t batch, const Tensor& query) {
  TORCH_CHECK(
      lengths.dim() == 1 && lengths.size(0) == batch && lengths.scalar_type() == at::kLong &&
          lengths.device() == query.device(),
      "attention_with_cache: ", name, " must be a (", batch, ",) int64 tensor on ", query.device(), ", but got ",
      lengths.sizes(), " ", lengths.scalar_type(), " on ", lengths.device());
}

// The caller's key_padding_mask (N, S) over cache positions [0, S), as an additive (N, S) mask in
// the query's dtype.
OptionalTensor cache_padding(const OptionalTensor& kpm, const Tensor& query, int64_t max_length, bool batch_first) {
  if (!is_present(kpm)) {
    return std::nullopt;
  }
  const int64_t batch = query.size(batch_dim(batch_first));
  check_mask_kind(kpm, "key_padding_mask");
  // S may be symbolic under torch.compile (a mask that grows with the sequence): kept so.
  TORCHMHA_CHECK_ARG(
      kpm->dim() == 2 && kpm->sym_size(0) == batch && kpm->sym_size(1).sym_le(max_length).expect_true(__FILE__, __LINE__),
      "attention_with_cache: expected key_padding_mask of shape (", batch, ", S) with S <= ", max_length,
      " (the cache's positions it masks), but got ", kpm->sym_sizes());
  auto padding = padding_bias(kpm, batch, kpm->sym_size(1), query.scalar_type());
  check_mask_dtype(padding, query.scalar_type());
  return padding->view_symint({batch, kpm->sym_size(1)});
}

// The caller's key_padding_mask (N, S) over a fixed memory, as an additive (N, 1, 1, S) mask in
// the query's dtype.
OptionalTensor checked_padding(const OptionalTensor& kpm, const Tensor& query, int64_t src_len, bool batch_first) {
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

Tensor attention_with_cache(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                            const OptionalTensor& new_lengths, const AttentionWeights& w, const DecodingCall& call) {
  // validate, the masks too, before the caches are written, so a bad call leaves them as they were
  check_cache(query, k_cache, v_cache, lengths, w, call);
  const int64_t batch = query.size(batch_dim(call.batch_first));
  check_lengths(lengths, "lengths", batch, query);
  if (is_present(new_lengths)) {
    check_lengths(*new_lengths, "new_lengths", batch, query);
  }
  const auto padding = cache_padding(call.key_padding_mask, query, k_cache.size(2), call.batch_first);

  // project: one packed GEMM for q|k|v of the new positions
  auto [q, k, v] = project_to_heads(query, query, query, w.in_proj, Sharing::kSelfAttention, w.num_heads,
                                    call.batch_first);
  // write the cache, attend and count the new positions (decode_attention), output projection
  auto heads = decode_attention(q, k, v, k_cache, v_cache, lengths, new_lengths, padding, call.effective_dropout());
  return zero_rows_past(project_output(heads, w, call.batch_first), new_lengths, call.batch_first);
}

Tensor zero_rows_past(const Tensor& output, const OptionalTensor& new_lengths, bool batch_first) {
  if (!is_present(new_lengths)) {
    return output;
  }
  // rows past a sequence's new positions are zeros, not the bias
  const Tensor steps = at::arange(output.size(sequence_dim(batch_first)), new_lengths->options());
  const Tensor row_is_new = batch_first ? steps.unsqueeze(0) < new_lengths->unsqueeze(1)
                                        : steps.unsqueeze(1) < new_lengths->unsqueeze(0);
  return output.masked_fill(row_is_new.logical_not().unsqueeze(-1), 0);
}

Tensor checked_reorder_index(const Tensor& indices, const Tensor& lengths, const char* who) {
  const int64_t batch = lengths.size(0);
  TORCH_CHECK(
      indices.dim() == 1 && indices.size(0) == batch && !at::isFloatingType(indices.scalar_type()) &&
          indices.scalar_type() != at::kBool,
      who, ": expected indices of shape (", batch, ",) (an integer index per sequence), but got ",
      indices.sizes(), " ", indices.scalar_type());
  return indices.to(lengths.device(), at::kLong);
}

void reorder_cache(const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths, const Tensor& indices) {
  const Tensor index = checked_reorder_index(indices, lengths, "KeyValueCache.reorder");
  const auto filled = filled_length(lengths);
  reorder_rows(k_cache, 0, 2, index, filled);
  reorder_rows(v_cache, 0, 2, index, filled);
  lengths.copy_(lengths.index_select(0, index));
}

void reorder_rows(const Tensor& cache, int64_t batch_dim, int64_t position_dim, const Tensor& index,
                  std::optional<int64_t> filled) {
  // Only the filled prefix moves where its length is known for free (filled_length): the rest
  // holds nothing any sequence reads. index_select copies first, so row i may read a row that
  // is overwritten in place.
  const Tensor rows = filled.has_value() ? cache.narrow(position_dim, 0, *filled) : cache;
  rows.copy_(rows.index_select(batch_dim, index));
}

void reset_cache(const Tensor& lengths, const OptionalTensor& slots) {
  if (!is_present(slots)) {
    lengths.zero_();
    return;
  }
  TORCH_CHECK(slots->dim() <= 1 && !at::isFloatingType(slots->scalar_type()),
              "KeyValueCache.reset: expected slots as a 1-D integer index or bool mask, but got ", slots->sizes(), " ",
              slots->scalar_type());
  if (slots->scalar_type() == at::kBool) {
    lengths.masked_fill_(slots->to(lengths.device()), 0);
  } else {
    lengths.index_fill_(0, slots->to(lengths.device(), at::kLong), 0);
  }
}

std::tuple<Tensor, Tensor> key_value_heads(const Tensor& key, const Tensor& value, const AttentionWeights& w,
                                           bool batch_first) {
  check_no_extra_key_positions(w, "project_key_value");
  checked_head_dim(w);
  check_batched(key, "key", "project_key_value");
  check_batched(value, "value", "project_key_value");
  check_key_value_shapes(key, value, /*separate_weights=*/true, batch_first);
  check_in_projection(w.in_proj, w.in_proj.inner(), -1, key.size(-1), value.size(-1));
  auto heads = project_to_heads(Tensor(), key, value, w.in_proj, sharing_of(Tensor(), key, value), w.num_heads,
                                batch_first);
  return std::make_tuple(std::move(heads[1]), std::move(heads[2]));
}

std::tuple<Tensor, Tensor> project_key_value(const Tensor& key, const Tensor& value, const AttentionWeights& w,
                                             bool batch_first) {
  auto [keys, values] = key_value_heads(key, value, w, batch_first);
  // Contiguous once here, so every decoding step reads them without a copy.
  return std::make_tuple(keys.contiguous(), values.contiguous());
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
  return project_output(attend_fixed_keys(heads[0], keys, values, mask, call.effective_dropout()), w,
                        call.batch_first);
}

}  // namespace torchmha::core
