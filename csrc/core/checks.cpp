// The validate step (checks.h).

#include "checks.h"

#include <torchmha/errors.h>

namespace torchmha::core {
namespace {

const char* layout_name(bool batched) {
  return batched ? "batched (3-D)" : "unbatched (2-D)";
}

// The (L, N, E) shape that torch's functional forward sees (and names in its messages): batch_first
// inputs transposed, unbatched ones with a batch of 1.
std::vector<int64_t> sequence_first_shape(const Tensor& x, bool batch_first) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (x.dim() == 2) {
    shape.insert(shape.begin() + 1, 1);
  } else if (x.dim() == 3 && batch_first) {
    std::swap(shape[0], shape[1]);
  }
  return shape;
}

}  // namespace

void check_mask_kind(const OptionalTensor& mask, const char* name) {
  if (!is_present(mask)) {
    return;
  }
  TORCHMHA_CHECK_ARG(
      mask->scalar_type() == at::kBool || at::isFloatingType(mask->scalar_type()), "only bool and floating types of ",
      name, " are supported\n(got ", name, " of dtype ", mask->scalar_type(), " and shape ", mask->sizes(), ")");
}

namespace {

// Ranks: batched (3-D) or unbatched (2-D), with matching keys, values and masks.
bool check_ranks(const ForwardCall& call, int64_t num_heads) {
  const auto& query = call.query;
  const int64_t rank = query.dim();
  TORCHMHA_CHECK_ARG(
      rank == 2 || rank == 3, "query should be unbatched 2D or batched 3D tensor but received ", rank,
      "-D query tensor\n(query of shape ", query.sizes(), ")");
  const bool batched = rank == 3;
  const char* layout = layout_name(batched);
  TORCHMHA_CHECK_ARG(
      call.key.dim() == rank && call.value.dim() == rank, "For ", layout, " `query`, expected `key` and `value` to be ",
      rank, "-D but found ", call.key.dim(), "-D and ", call.value.dim(), "-D tensors respectively\n(query of shape ",
      query.sizes(), ", key of shape ", call.key.sizes(), ", value of shape ", call.value.sizes(), ")");
  const auto& kpm = call.key_padding_mask;
  TORCHMHA_CHECK_ARG(
      !is_present(kpm) || kpm->dim() == rank - 1, "For ", layout, " `query`, expected `key_padding_mask` to be `None` or ",
      rank - 1, "-D but found ", kpm->dim(), "-D tensor instead\n(key_padding_mask of shape ", kpm->sizes(), ")");
  const auto& mask = call.attn_mask;
  TORCHMHA_CHECK_ARG(
      !is_present(mask) || mask->dim() == 2 || mask->dim() == 3, "For ", layout,
      " `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found ", mask->dim(),
      "-D tensor instead\n(attn_mask of shape ", mask->sizes(), ")");
  if (!batched && is_present(mask) && mask->dim() == 3) {
    const int64_t tgt_len = query.size(0), src_len = call.key.size(0);
    TORCHMHA_CHECK_ARG(
        mask->size(0) == num_heads && mask->size(1) == tgt_len && mask->size(2) == src_len,
        "Expected `attn_mask` shape to be (", num_heads, ", ", tgt_len, ", ", src_len, ") but got ",
        torch_size(mask->sizes()), "\n(num_heads, target length, source length for unbatched query)");
  }
  return batched;
}

// static_k / static_v (N*H, S, D), torch's checks and messages.
void check_static_keys(const OptionalTensor& keys, const char* name, const char* what, const AttentionWeights& w,
                       const Geometry& g) {
  if (!is_present(keys)) {
    return;
  }
  TORCHMHA_CHECK_ARG(!is_present(w.bias_k), "bias cannot be added to static ", what, ".");
  TORCHMHA_CHECK_ARG(
      keys->dim() == 3, "expecting a 3-D ", name, " (batch * num_heads, source length, head_dim), but got ", name,
      " of shape ", keys->sizes());
  TORCHMHA_CHECK_ARG(
      keys->size(0) == g.batch * w.num_heads, "expecting ", name, ".size(0) of ", g.batch * w.num_heads, ", but got ",
      keys->size(0));
  TORCHMHA_CHECK_ARG(
      keys->size(2) == g.head_dim, "expecting ", name, ".size(2) of ", g.head_dim, ", but got ", keys->size(2));
}

}  // namespace

void check_positive_sizes(int64_t embed_dim, int64_t num_heads) {
  TORCH_CHECK_VALUE(
      embed_dim > 0 && num_heads > 0, "embed_dim and num_heads must be greater than 0, got embed_dim=", embed_dim,
      " and num_heads=", num_heads, " instead");
}

void check_divisible(int64_t embed_dim, int64_t num_heads) {
  TORCHMHA_CHECK_ARG(
      embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads\n(got embed_dim=", embed_dim,
      " and num_heads=", num_heads, ")");
}

void check_module_sizes(int64_t embed_dim, int64_t num_heads, int64_t kdim, int64_t vdim) {
  check_positive_sizes(embed_dim, num_heads);
  check_divisible(embed_dim, num_heads);
  TORCH_CHECK_VALUE(
      (kdim == -1 || kdim > 0) && (vdim == -1 || vdim > 0), "kdim and vdim must be greater than 0, got kdim=", kdim,
      " and vdim=", vdim);
}

void check_dropout(double p) {
  TORCH_CHECK_VALUE(p >= 0.0 && p <= 1.0, "dropout probability has to be between 0 and 1, but got ", p);
}

void check_key_value_shapes(const Tensor& key, const Tensor& value, bool separate_weights, bool batch_first) {
  // torch names the shapes in its (S, N, E) layout.
  const auto k = sequence_first_shape(key, batch_first), v = sequence_first_shape(value, batch_first);
  if (separate_weights) {
    TORCHMHA_CHECK_ARG(
        key.dim() == value.dim() && key.sizes().slice(0, key.dim() - 1) == value.sizes().slice(0, value.dim() - 1),
        "key's sequence and batch dims ", torch_size(c10::IntArrayRef(k).slice(0, 2)), " do not match value's ",
        torch_size(c10::IntArrayRef(v).slice(0, 2)));
  } else {
    TORCHMHA_CHECK_ARG(
        key.sizes() == value.sizes(), "key shape ", torch_size(c10::IntArrayRef(k)), " does not match value shape ", torch_size(c10::IntArrayRef(v)));
  }
}

Geometry validate_forward(const ForwardCall& call, const AttentionWeights& weights, int64_t embed_dim) {
  const int64_t num_heads = weights.num_heads;
  check_positive_sizes(embed_dim, num_heads);
  if (call.training) {  // torch never reads the probability in eval, so never rejects it there
    check_dropout(call.dropout_p);
  }
  const bool batched = check_ranks(call, num_heads);
  const int64_t seq = batched ? sequence_dim(call.batch_first) : 0;
  Geometry g{batched, batched ? call.query.size(batch_dim(call.batch_first)) : 1, call.query.size(seq),
             call.key.size(seq), 0};
  TORCH_CHECK(
      !call.is_causal || is_present(call.attn_mask),
      "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
      "`generate_square_subsequent_mask` to create this mask.");
  TORCHMHA_CHECK_ARG(
      call.query.size(-1) == embed_dim, "was expecting embedding dimension of ", embed_dim, ", but got ",
      call.query.size(-1), "\n(query of shape ", call.query.sizes(), ")");
  if (weights.head_dim) {  // the in-projection's own width (head parallelism)
    TORCHMHA_CHECK_ARG(*weights.head_dim > 0, "head_dim must be greater than 0, but got ", *weights.head_dim);
    g.head_dim = *weights.head_dim;
  } else {
    TORCHMHA_CHECK_ARG(embed_dim % num_heads == 0, "embed_dim ", embed_dim, " not divisible by num_heads ",
                       num_heads);
    g.head_dim = embed_dim / num_heads;
  }
  const bool separate = !weights.in_proj.packed();
  if (separate) {
    const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
    for (int part = 0; part < 3; ++part) {
      TORCHMHA_CHECK_ARG(
          is_present(weights.in_proj.weights[part]), "use_separate_proj_weight is True but ", names[part], " is None");
    }
  }
  check_key_value_shapes(call.key, call.value, separate, call.batch_first);
  if (batched) {
    TORCH_CHECK(
        call.key.size(batch_dim(call.batch_first)) == g.batch, "key and value must have the batch size of query (",
        g.batch, "), but got query of shape ", call.query.sizes(), " and key of shape ", call.key.sizes());
  }
  return g;
}

void check_padding_mask_shape(
    const Tensor& mask,
    int64_t batch,
    const c10::SymInt& src_len,
    bool batched,
    int64_t extra_positions) {
  // torch checks after appending bias_k/zero positions to keys and mask, and names its sizes then.
  // sym_size (a plain size() specializes every dimension under tracing) and expect_true: under
  // tracing a runtime assertion on a symbolic length, not a guard on it.
  const c10::SymInt length = mask.sym_size(-1);
  TORCHMHA_CHECK_ARG(
      !batched || mask.sym_size(0) == batch, "Expected key_padded_mask.shape[0] to be ", batch, ", but got ",
      mask.sym_size(0),
      "\n(key_padding_mask of shape ", mask.sym_sizes(), ")");
  TORCHMHA_CHECK_ARG(
      length.sym_eq(src_len).expect_true(__FILE__, __LINE__), "Expected key_padded_mask.shape[1] to be ",
      src_len + extra_positions, ", but got ", length + extra_positions, "\n(key_padding_mask of shape ",
      mask.sym_sizes(), ")");
}

void check_mask_shapes(
    const ForwardCall& call,
    const AttentionWeights& weights,
    const Geometry& g,
    bool attn_mask_is_read) {
  const auto& mask = call.attn_mask;
  if (is_present(mask) && attn_mask_is_read) {
    if (mask->dim() == 2) {
      TORCH_CHECK(
          mask->size(0) == g.tgt_len && mask->size(1) == g.src_len, "The shape of the 2D attn_mask is ",
          torch_size(mask->sizes()), ", but should be (", g.tgt_len, ", ", g.src_len, ").");
    } else {
      const int64_t batch_heads = g.batch * weights.num_heads;
      TORCH_CHECK(
          mask->size(0) == batch_heads && mask->size(1) == g.tgt_len && mask->size(2) == g.src_len,
          "The shape of the 3D attn_mask is ", torch_size(mask->sizes()), ", but should be (", batch_heads, ", ",
          g.tgt_len, ", ", g.src_len, ").");
    }
  }
  check_static_keys(call.static_k, "static_k", "key", weights, g);
  check_static_keys(call.static_v, "static_v", "value", weights, g);
  TORCHMHA_CHECK_ARG(
      is_present(weights.bias_k) == is_present(weights.bias_v),
      is_present(weights.bias_k) ? "bias_k is set but bias_v is None" : "bias_v is set but bias_k is None");
  if (is_present(call.key_padding_mask)) {
    // With static keys, the padding mask covers them, as in torch.
    const int64_t src_len = is_present(call.static_k) ? call.static_k->size(1) : g.src_len;
    const int64_t extra = (is_present(weights.bias_k) ? 1 : 0) + (weights.add_zero_attn ? 1 : 0);
    check_padding_mask_shape(*call.key_padding_mask, g.batch, src_len, g.batched, extra);
  }
}

void warn_if_mask_dtypes_differ(const OptionalTensor& key_padding_mask, const OptionalTensor& attn_mask) {
  if (is_present(key_padding_mask) && is_present(attn_mask) &&
      key_padding_mask->scalar_type() != attn_mask->scalar_type()) {
    // torch's text, so warning filters written against torch match.
    TORCH_WARN("Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both instead.");
  }
}

void check_mask_dtype(const OptionalTensor& mask, at::ScalarType query_dtype) {
  TORCH_CHECK(
      !is_present(mask) || mask->scalar_type() == query_dtype, "float masks must have the dtype of query (",
      query_dtype, "), but the masks given combine to ", mask->scalar_type(),
      " (a float attn_mask or key_padding_mask is added in the query's dtype, never converted)");
}

void check_batched(const Tensor& x, const char* name, const char* function) {
  TORCHMHA_CHECK_ARG(
      x.dim() == 3, function, ": expected a batched 3-D ", name, " ((L, N, E), or (N, L, E) with batch_first), but got ",
      name, " of shape ", x.sizes());
}

void check_no_extra_key_positions(const AttentionWeights& weights, const char* method) {
  TORCH_CHECK(
      !weights.has_extra_key_positions(), "MultiheadAttention.", method,
      " does not support add_bias_kv or add_zero_attn (they append key positions a cache does not hold)");
}

void check_heads(const Tensor& keys, int64_t num_heads, int64_t head_dim, const char* what) {
  TORCHMHA_CHECK_ARG(
      keys.dim() == 4 && keys.size(1) == num_heads && keys.size(3) == head_dim, "MultiheadAttention.forward_with_cache: ",
      what, " has keys of shape ", keys.sizes(), " (batch, heads, length, head_dim), but the module has ", num_heads,
      " heads of size ", head_dim);
}

void check_keys_values(
    const Tensor& query,
    const Tensor& keys,
    const Tensor& values,
    bool batch_first,
    const char* function,
    const char* keys_name,
    const char* values_name,
    const char* hint) {
  TORCHMHA_CHECK_ARG(
      keys.dim() == 4 && keys.sizes() == values.sizes(), function, ": expected ", keys_name, " and ", values_name,
      " of the same shape (batch, heads, length, head_dim), but got ", keys_name, " of shape ", keys.sizes(), " and ",
      values_name, " of shape ", values.sizes());
  const int64_t batch = query.size(batch_dim(batch_first));
  TORCHMHA_CHECK_ARG(
      keys.size(0) == batch, function, ": ", keys_name, " and ", values_name, " hold batches of ", keys.size(0),
      ", but query of shape ", query.sizes(), " has batch size ", batch, hint);
}

}  // namespace torchmha::core
