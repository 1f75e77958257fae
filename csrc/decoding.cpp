// Key/value caching for incremental decoding, CrossAttention and TransformerBlock. Like the rest
// of the functional core, everything here is differentiable ATen ops; the attention itself is
// at::scaled_dot_product_attention on heads split by the core's helpers (functional.h, detail).

#include <torchmha/decoding.h>
#include <torchmha/errors.h>
#include <torchmha/functional.h>

#include <ATen/ATen.h>

#include <cmath>

namespace torchmha {
namespace {

using at::Tensor;

using detail::optional_if_defined;

void check_batched_input(const Tensor& x, const char* name, const char* function) {
  TORCHMHA_CHECK_ARG(
      x.dim() == 3, function, ": expected a batched 3-D ", name, " ((L, N, E), or (N, L, E) with batch_first), but got ",
      name, " of shape ", x.sizes());
}

// x (L, N, E_in) or (N, L, E_in) -> (N, H, L, inner / H) through w (inner, E_in).
Tensor project_to_heads(
    const Tensor& x,
    const Tensor& w,
    const std::optional<Tensor>& b,
    int64_t num_heads,
    bool batch_first,
    const char* weight_name) {
  TORCHMHA_CHECK_ARG(
      w.dim() == 2 && w.size(1) == x.size(-1) && w.size(0) % num_heads == 0, "an input of shape ", x.sizes(),
      " (embedding size ", x.size(-1), ") needs ", weight_name, " of shape (num_heads * head_dim, ", x.size(-1),
      ") with num_heads = ", num_heads, ", but got ", weight_name, " of shape ", w.sizes());
  const int64_t head_dim = w.size(0) / num_heads;
  return detail::to_heads(at::linear(x, w, b), /*parts=*/1, num_heads, head_dim, batch_first)[0];
}

// Checks shared by both cached attentions: a batched query; keys and values (N, H, S, D) of one
// shape with query's batch size N; w_q projecting to H * D. `hint` ends the batch-size message.
void check_query_and_heads(
    const Tensor& query,
    const Tensor& keys,
    const Tensor& values,
    const Tensor& w_q,
    bool batch_first,
    const char* function,
    const char* keys_name,
    const char* values_name,
    const char* hint) {
  check_batched_input(query, "query", function);
  TORCHMHA_CHECK_ARG(
      keys.dim() == 4 && keys.sizes() == values.sizes(), function, ": expected ", keys_name, " and ", values_name,
      " of the same shape (batch, heads, length, head_dim), but got ", keys_name, " of shape ", keys.sizes(), " and ",
      values_name, " of shape ", values.sizes());
  const int64_t batch = query.size(batch_first ? 0 : 1);
  TORCHMHA_CHECK_ARG(
      keys.size(0) == batch, function, ": ", keys_name, " and ", values_name, " hold batches of ", keys.size(0),
      ", but query of shape ", query.sizes(), " has batch size ", batch, hint);
  const int64_t inner = keys.size(1) * keys.size(3);
  TORCHMHA_CHECK_ARG(
      w_q.size(0) == inner, function, ": ", keys_name, " have ", keys.size(1), " heads of size ", keys.size(3),
      ", so w_q must have ", inner, " rows, but got w_q of shape ", w_q.sizes());
}

void check_dropout(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0, "dropout_p must be in [0, 1], but got ", dropout_p);
}

// The one attention computation of this file (scale 1/sqrt(head_dim), as SDPA's default).
// additive_mask: undefined or float, broadcastable to (N, H, T, S).
Tensor attend_heads(
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const Tensor& additive_mask,
    double dropout_p,
    bool training,
    const Tensor& w_out,
    const std::optional<Tensor>& b_out,
    bool batch_first) {
  auto heads = at::scaled_dot_product_attention(
      q, k, v, optional_if_defined(additive_mask), training ? dropout_p : 0.0, /*is_causal=*/false);
  return at::linear(detail::merge_heads(heads, batch_first), w_out, b_out);
}

// key_padding_mask (N, S) -> additive (N, 1, 1, S) in `dtype`; undefined when absent. S may be
// symbolic (a cache's length under torch.compile), so it is compared and viewed as a SymInt.
Tensor padding_bias(
    const std::optional<Tensor>& key_padding_mask,
    int64_t batch,
    const c10::SymInt& src_len,
    at::ScalarType dtype) {
  if (!key_padding_mask.has_value() || !key_padding_mask->defined()) {
    return Tensor();
  }
  const Tensor& mask = *key_padding_mask;
  // expect_true: a runtime assertion under tracing rather than a guard on the length.
  TORCHMHA_CHECK_ARG(
      mask.dim() == 2 &&
          mask.sym_size(0).sym_eq(batch).sym_and(mask.sym_size(1).sym_eq(src_len)).expect_true(__FILE__, __LINE__),
      "expected key_padding_mask of shape (", batch, ", ", src_len,
      ") (batch, number of keys attended so far), but got ", mask.sym_sizes());
  auto additive = detail::canonical_mask(mask, "key_padding_mask", dtype);
  // As the main path (and torch): a float mask is added in the query's dtype, never converted.
  TORCH_CHECK(
      additive.scalar_type() == dtype, "a float key_padding_mask must have the dtype of query (", dtype,
      "), but got ", additive.scalar_type());
  return additive.view_symint({batch, 1, 1, src_len});
}

}  // namespace

// ------------------------------------------------------------------------ functional entry points
Tensor attention_with_cache(
    const Tensor& query,
    const Tensor& k_cache,
    const Tensor& v_cache,
    c10::SymInt cache_length,
    const Tensor& w_q,
    const std::optional<Tensor>& b_q,
    const Tensor& w_k,
    const std::optional<Tensor>& b_k,
    const Tensor& w_v,
    const std::optional<Tensor>& b_v,
    const Tensor& w_out,
    const std::optional<Tensor>& b_out,
    const std::optional<Tensor>& key_padding_mask,
    double dropout_p,
    bool training,
    bool batch_first) {
  check_query_and_heads(
      query, k_cache, v_cache, w_q, batch_first, "attention_with_cache", "k_cache", "v_cache",
      "; reset the cache for the new batch size");
  // The new keys and values are written into the cache: their projections must match its heads.
  auto check_projects_like_w_q = [&](const Tensor& w, const char* name) {
    TORCHMHA_CHECK_ARG(
        w.dim() == 2 && w.size(0) == w_q.size(0), "attention_with_cache: expected ", name, " of shape (",
        w_q.size(0), ", ", query.size(-1), ") like w_q, but got ", name, " of shape ", w.sizes());
  };
  check_projects_like_w_q(w_k, "w_k");
  check_projects_like_w_q(w_v, "w_v");
  // Else copy_ would convert the new keys into the cache and SDPA fail only after that write.
  // (Not checked for static keys: under autocast those are projected in lower precision.)
  TORCH_CHECK(
      k_cache.scalar_type() == query.scalar_type() && k_cache.device() == query.device(),
      "attention_with_cache: the cache must have query's dtype and device (", query.scalar_type(), ", ",
      query.device(), "), but got ", k_cache.scalar_type(), ", ", k_cache.device());
  check_dropout(dropout_p);
  const int64_t batch = query.size(batch_first ? 0 : 1);
  const int64_t new_len = query.size(batch_first ? 1 : 0);
  const int64_t num_heads = k_cache.size(1), max_length = k_cache.size(2);
  // cache_length grows every step; under torch.compile it is symbolic, and everything that
  // depends on it stays symbolic (sym checks, narrow_symint, arange) so that one graph serves
  // every step instead of one recompilation per length.
  TORCH_CHECK_VALUE(
      cache_length.sym_ge(0).sym_and(cache_length.sym_le(max_length)).expect_true(__FILE__, __LINE__),
      "cache_length must be in [0, ", max_length, "], but got ", cache_length);
  const c10::SymInt src_len = cache_length + new_len;
  TORCH_SYM_CHECK(
      src_len.sym_le(max_length), "the key/value cache is full: it holds ", cache_length, " of its ", max_length,
      " positions and cannot take ", new_len, " more; make it with a larger max_length or reset() it");

  // Checked before the caches are written, so a bad mask leaves them as they were.
  auto padding = padding_bias(key_padding_mask, batch, src_len, query.scalar_type());
  auto q = project_to_heads(query, w_q, b_q, num_heads, batch_first, "w_q");
  auto k = project_to_heads(query, w_k, b_k, num_heads, batch_first, "w_k");
  auto v = project_to_heads(query, w_v, b_v, num_heads, batch_first, "w_v");
  k_cache.narrow_symint(2, cache_length, new_len).copy_(k);
  v_cache.narrow_symint(2, cache_length, new_len).copy_(v);

  // Query i sits at absolute position cache_length + i and may see keys 0 .. cache_length + i.
  // (SDPA's is_causal would align the triangle top-left when new_len != src_len: wrong here.)
  // One new position sees every cached key, so it needs no mask at all.
  Tensor mask;
  if (new_len > 1) {
    auto index_options = query.options().dtype(at::kLong);
    auto query_position = at::arange(new_len, index_options).unsqueeze(1) + cache_length;
    auto future = at::arange(c10::Scalar(src_len), index_options).unsqueeze(0) > query_position;
    mask = detail::canonical_mask(future, "causal mask", query.scalar_type());
  }
  if (padding.defined()) {
    mask = mask.defined() ? mask + padding : padding;
  }
  return attend_heads(
      q, k_cache.narrow_symint(2, 0, src_len), v_cache.narrow_symint(2, 0, src_len), mask, dropout_p, training,
      w_out, b_out, batch_first);
}

std::tuple<Tensor, Tensor> project_key_value(
    const Tensor& key,
    const Tensor& value,
    int64_t num_heads,
    const Tensor& w_k,
    const std::optional<Tensor>& b_k,
    const Tensor& w_v,
    const std::optional<Tensor>& b_v,
    bool batch_first) {
  TORCH_CHECK_VALUE(num_heads > 0, "num_heads must be greater than 0, but got ", num_heads);
  check_batched_input(key, "key", "project_key_value");
  check_batched_input(value, "value", "project_key_value");
  TORCHMHA_CHECK_ARG(
      key.size(0) == value.size(0) && key.size(1) == value.size(1),
      "key's sequence and batch sizes must match value's, but got key of shape ", key.sizes(), " and value of shape ",
      value.sizes());
  // Contiguous once here, so every decoding step reads them without a copy.
  return std::make_tuple(
      project_to_heads(key, w_k, b_k, num_heads, batch_first, "w_k").contiguous(),
      project_to_heads(value, w_v, b_v, num_heads, batch_first, "w_v").contiguous());
}

Tensor attention_with_static_key_value(
    const Tensor& query,
    const Tensor& keys,
    const Tensor& values,
    const Tensor& w_q,
    const std::optional<Tensor>& b_q,
    const Tensor& w_out,
    const std::optional<Tensor>& b_out,
    const std::optional<Tensor>& key_padding_mask,
    double dropout_p,
    bool training,
    bool batch_first) {
  check_query_and_heads(
      query, keys, values, w_q, batch_first, "attention_with_static_key_value", "keys", "values",
      " (project the context again for this batch)");
  check_dropout(dropout_p);
  const int64_t batch = query.size(batch_first ? 0 : 1);
  const int64_t num_heads = keys.size(1), src_len = keys.size(2);
  auto q = project_to_heads(query, w_q, b_q, num_heads, batch_first, "w_q");
  auto mask = padding_bias(key_padding_mask, batch, src_len, query.scalar_type());
  return attend_heads(q, keys, values, mask, dropout_p, training, w_out, b_out, batch_first);
}

// --------------------------------------------------------------------------------- KeyValueCache
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

KeyValueCache KeyValueCache::for_module(const MultiheadAttentionImpl& attention, int64_t batch_size, int64_t max_length) {
  return KeyValueCache(
      batch_size, attention.options.num_heads(), max_length, attention.head_dim, attention.out_proj->weight.options());
}

void KeyValueCache::reset() {
  length_ = 0;
}

void KeyValueCache::reset(int64_t new_batch_size) {
  TORCH_CHECK_VALUE(new_batch_size > 0, "batch_size must be greater than 0, but got ", new_batch_size);
  if (new_batch_size != batch_size()) {
    auto sizes = keys_.sizes().vec();
    sizes[0] = new_batch_size;
    keys_ = at::zeros(sizes, keys_.options());
    values_ = at::zeros_like(keys_);
  }
  length_ = 0;
}

Tensor KeyValueCache::attend(
    const Tensor& query,
    const Tensor& w_q,
    const std::optional<Tensor>& b_q,
    const Tensor& w_k,
    const std::optional<Tensor>& b_k,
    const Tensor& w_v,
    const std::optional<Tensor>& b_v,
    const Tensor& w_out,
    const std::optional<Tensor>& b_out,
    const std::optional<Tensor>& key_padding_mask,
    double dropout_p,
    bool training,
    bool batch_first) {
  auto output = attention_with_cache(
      query, keys_, values_, length_, w_q, b_q, w_k, b_k, w_v, b_v, w_out, b_out, key_padding_mask, dropout_p,
      training, batch_first);
  length_ += query.size(batch_first ? 1 : 0);  // only after the checks above passed
  return output;
}

// --------------------------------------------------------- MultiheadAttention with caches
namespace {

struct InProjection {
  Tensor w_q, w_k, w_v;
  std::optional<Tensor> b_q, b_k, b_v;
};

// The module's q/k/v weights as three tensors (views into the packed ones when packed).
InProjection in_projection_of(const MultiheadAttentionImpl& m) {
  InProjection p;
  if (m.qkv_same_embed_dim) {
    auto w = m.in_proj_weight.chunk(3);
    p.w_q = w[0], p.w_k = w[1], p.w_v = w[2];
  } else {
    p.w_q = m.q_proj_weight, p.w_k = m.k_proj_weight, p.w_v = m.v_proj_weight;
  }
  if (m.in_proj_bias.defined()) {
    auto b = m.in_proj_bias.chunk(3);
    p.b_q = b[0], p.b_k = b[1], p.b_v = b[2];
  }
  return p;
}

void check_no_extra_key_positions(const MultiheadAttentionImpl& m, const char* method) {
  TORCH_CHECK(
      !m.options.add_bias_kv() && !m.options.add_zero_attn(), "MultiheadAttention.", method,
      " does not support add_bias_kv or add_zero_attn (they append key positions a cache does not hold)");
}

// Keys and values split into heads some other way would pass every shape check of the ops
// (only H * head_dim must match) and silently attend with the wrong heads.
void check_heads_match(const MultiheadAttentionImpl& m, const Tensor& keys, const char* what) {
  TORCHMHA_CHECK_ARG(
      keys.dim() == 4 && keys.size(1) == m.options.num_heads() && keys.size(3) == m.head_dim,
      "MultiheadAttention.forward_with_cache: ", what, " has keys of shape ", keys.sizes(),
      " (batch, heads, length, head_dim), but the module has ", m.options.num_heads(), " heads of size ", m.head_dim);
}

}  // namespace

Tensor MultiheadAttentionImpl::forward_with_cache(const Tensor& query, KeyValueCache& cache, const Tensor& key_padding_mask) {
  check_no_extra_key_positions(*this, "forward_with_cache");
  TORCH_CHECK(
      qkv_same_embed_dim, "MultiheadAttention.forward_with_cache with a KeyValueCache is self-attention, so it needs "
      "kdim == vdim == embed_dim (", options.embed_dim(), "), but kdim is ", options.kdim().value_or(options.embed_dim()),
      " and vdim ", options.vdim().value_or(options.embed_dim()));
  check_heads_match(*this, cache.keys(), "the cache");
  auto p = in_projection_of(*this);
  return cache.attend(
      query, p.w_q, p.b_q, p.w_k, p.b_k, p.w_v, p.b_v, out_proj->weight, optional_if_defined(out_proj->bias),
      optional_if_defined(key_padding_mask), options.dropout(), is_training(), options.batch_first());
}

Tensor MultiheadAttentionImpl::forward_with_cache(
    const Tensor& query,
    const StaticKeyValue& memory,
    const Tensor& key_padding_mask) {
  check_no_extra_key_positions(*this, "forward_with_cache");
  check_heads_match(*this, memory.keys, "the projected memory");
  auto p = in_projection_of(*this);
  return attention_with_static_key_value(
      query, memory.keys, memory.values, p.w_q, p.b_q, out_proj->weight, optional_if_defined(out_proj->bias),
      optional_if_defined(key_padding_mask), options.dropout(), is_training(), options.batch_first());
}

StaticKeyValue MultiheadAttentionImpl::project_key_value(const Tensor& key, const Tensor& value) {
  check_no_extra_key_positions(*this, "project_key_value");
  auto p = in_projection_of(*this);
  auto [keys, values] =
      torchmha::project_key_value(key, value, options.num_heads(), p.w_k, p.b_k, p.w_v, p.b_v, options.batch_first());
  return {keys, values};
}

// --------------------------------------------------------------------------- CrossAttention
CrossAttentionImpl::CrossAttentionImpl(const CrossAttentionOptions& options_) : options(options_) {
  reset();
}

void CrossAttentionImpl::reset() {
  const int64_t query_dim = options.query_dim();
  const int64_t context_dim = options.context_dim().value_or(query_dim);
  TORCH_CHECK_VALUE(
      query_dim > 0 && context_dim > 0 && options.heads() > 0 && options.dim_head() > 0,
      "CrossAttention sizes must be greater than 0, got query_dim=", query_dim, ", context_dim=", context_dim,
      ", heads=", options.heads(), ", dim_head=", options.dim_head());
  const int64_t inner = options.heads() * options.dim_head();
  using torch::nn::LinearOptions;
  to_q = register_module("to_q", torch::nn::Linear(LinearOptions(query_dim, inner).bias(false)));
  to_k = register_module("to_k", torch::nn::Linear(LinearOptions(context_dim, inner).bias(false)));
  to_v = register_module("to_v", torch::nn::Linear(LinearOptions(context_dim, inner).bias(false)));
  to_out = register_module("to_out", torch::nn::Linear(inner, query_dim));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
}

void CrossAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::CrossAttention(query_dim=" << options.query_dim()
         << ", context_dim=" << options.context_dim().value_or(options.query_dim()) << ", heads=" << options.heads()
         << ", dim_head=" << options.dim_head() << ", dropout=" << options.dropout() << ")";
}

Tensor CrossAttentionImpl::forward(const Tensor& x, const Tensor& context, const Tensor& mask) {
  return forward_with_cache(x, project_context(context.defined() ? context : x), mask);
}

StaticKeyValue CrossAttentionImpl::project_context(const Tensor& context) {
  auto [keys, values] = torchmha::project_key_value(
      context, context, options.heads(), to_k->weight, std::nullopt, to_v->weight, std::nullopt, /*batch_first=*/true);
  return {keys, values};
}

Tensor CrossAttentionImpl::forward_with_cache(const Tensor& x, const StaticKeyValue& context, const Tensor& mask) {
  Tensor key_padding_mask;
  if (mask.defined()) {
    TORCHMHA_CHECK_ARG(
        mask.scalar_type() == at::kBool, "CrossAttention's mask must be bool (true = keep), but got dtype ",
        mask.scalar_type());
    key_padding_mask = mask.logical_not();  // the core takes torch's convention, true = ignore
  }
  auto attended = attention_with_static_key_value(
      x, context.keys, context.values, to_q->weight, std::nullopt, to_out->weight, to_out->bias,
      optional_if_defined(key_padding_mask), /*dropout_p=*/0.0, is_training(), /*batch_first=*/true);
  return dropout(attended);
}

// ------------------------------------------------------------------------- TransformerBlock
TransformerBlockImpl::TransformerBlockImpl(const TransformerBlockOptions& options_) : options(options_) {
  reset();
}

void TransformerBlockImpl::reset() {
  const int64_t E = options.embed_dim();
  TORCH_CHECK_VALUE(
      options.forward_expansion() > 0, "forward_expansion must be greater than 0, but got ",
      options.forward_expansion());
  // Registration order of torch.nn.TransformerEncoderLayer, so parameters line up one to one.
  self_attn = register_module(
      "self_attn",
      MultiheadAttention(MultiheadAttentionOptions(E, options.num_heads()).dropout(options.dropout()).batch_first(true)));
  linear1 = register_module("linear1", torch::nn::Linear(E, options.forward_expansion() * E));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
  linear2 = register_module("linear2", torch::nn::Linear(options.forward_expansion() * E, E));
  auto norm_options = torch::nn::LayerNormOptions({E}).eps(options.layer_norm_eps());
  norm1 = register_module("norm1", torch::nn::LayerNorm(norm_options));
  norm2 = register_module("norm2", torch::nn::LayerNorm(norm_options));
}

void TransformerBlockImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::TransformerBlock(embed_dim=" << options.embed_dim() << ", num_heads=" << options.num_heads()
         << ", dropout=" << options.dropout() << ", forward_expansion=" << options.forward_expansion()
         << ", norm_first=" << options.norm_first() << ")";
}

Tensor TransformerBlockImpl::forward(const Tensor& x, const Tensor& attn_mask, const Tensor& key_padding_mask) {
  auto attention = [&](const Tensor& y) {
    return dropout(std::get<0>(self_attn->forward(y, y, y, key_padding_mask, /*need_weights=*/false, attn_mask)));
  };
  auto feed_forward = [&](const Tensor& y) { return dropout(linear2(dropout(at::relu(linear1(y))))); };
  if (options.norm_first()) {
    auto h = x + attention(norm1(x));
    return h + feed_forward(norm2(h));
  }
  auto h = norm1(x + attention(x));
  return norm2(h + feed_forward(h));
}

}  // namespace torchmha
