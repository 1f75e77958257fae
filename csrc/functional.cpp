// The functional core: in-projections and multi-head attention in differentiable ATen ops.
// Semantics follow torch.nn.MultiheadAttention (read from torch/nn/functional.py and
// torch/nn/modules/activation.py); the tests compare against the installed torch.

#include <torchmha/errors.h>
#include <torchmha/functional.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>

namespace torchmha {

// Shared with csrc/decoding.cpp (declared in functional.h, namespace detail).
namespace detail {

using at::Tensor;

// bool masks become additive float masks (-inf where true); float masks pass through.
Tensor canonical_mask(const Tensor& mask, const char* name, at::ScalarType target_dtype) {
  if (!mask.defined()) {
    return mask;
  }
  TORCHMHA_CHECK_ARG(
      mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()),
      "only bool and floating-point ", name, " are supported, but got ", name, " of dtype ",
      mask.scalar_type(), " and shape ", mask.sizes());
  if (mask.scalar_type() == at::kBool) {
    return at::zeros_like(mask, mask.options().dtype(target_dtype))
        .masked_fill_(mask, -std::numeric_limits<double>::infinity());
  }
  return mask;
}

// (len, N, parts*E) or (N, len, parts*E) -> `parts` tensors (N, H, len, head_dim), as strided
// views: SDPA's CPU flash kernel reads them in place (a contiguous copy measured ~25% slower), and
// the explicit-weights path's reshape copies only where a batched matmul needs it.
std::vector<Tensor> to_heads(const Tensor& x, int64_t parts, int64_t num_heads, int64_t head_dim, bool batch_first) {
  auto split = x.unflatten(-1, {parts, num_heads, head_dim});
  auto heads = batch_first ? split.permute({2, 0, 3, 1, 4}) : split.permute({2, 1, 3, 0, 4});
  return heads.unbind(0);
}

// (N, H, L, head_dim) -> (L, N, E) or (N, L, E), contiguous.
Tensor merge_heads(const Tensor& x, bool batch_first) {
  auto merged = batch_first ? x.permute({0, 2, 1, 3}) : x.permute({2, 0, 1, 3});
  return merged.flatten(-2);  // a copy, as the heads are not adjacent in x
}

}  // namespace detail

namespace {

using at::Tensor;
using detail::canonical_mask;
using detail::merge_heads;
using detail::to_heads;

// Which of _in_projection_packed's three cases applies; decided by tensor identity.
enum class PackedCase { kSelfAttention, kSharedKeyValue, kSeparate };

PackedCase packed_case(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (k.is_same(v)) {
    return q.is_same(k) ? PackedCase::kSelfAttention : PackedCase::kSharedKeyValue;
  }
  return PackedCase::kSeparate;
}

bool is_present(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined();
}

std::optional<Tensor> narrow_or_none(const std::optional<Tensor>& t, int64_t start, int64_t length) {
  if (!is_present(t)) {
    return std::nullopt;
  }
  return t->narrow(0, start, length);
}

// The packed in-projection as the GEMMs it runs: each output holds `parts` consecutive
// projections (q|k|v for self-attention; q, then k|v for encoder-decoder; else q, k, v apart).
// The case is passed in because callers may have lost tensor identity (e.g. by adding a batch dim).
struct ProjectionGroup {
  Tensor output;
  int64_t parts;
};

std::vector<ProjectionGroup> packed_projection_gemms(
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const Tensor& w,
    const std::optional<Tensor>& b,
    PackedCase which) {
  const int64_t E = q.size(-1);
  TORCH_CHECK(
      w.dim() == 2 && w.size(0) == 3 * E && w.size(1) == E,
      "in_proj_weight must have shape (3 * embed_dim, embed_dim) = (", 3 * E, ", ", E,
      ") for inputs of embedding size ", E, ", but got ", w.sizes());
  TORCH_CHECK(
      !is_present(b) || (b->dim() == 1 && b->size(0) == 3 * E),
      "in_proj_bias must have shape (3 * embed_dim,) = (", 3 * E, ",), but got ", b->sizes());
  switch (which) {
    case PackedCase::kSelfAttention:
      return {{at::linear(q, w, b), 3}};
    case PackedCase::kSharedKeyValue:
      return {
          {at::linear(q, w.narrow(0, 0, E), narrow_or_none(b, 0, E)), 1},
          {at::linear(k, w.narrow(0, E, 2 * E), narrow_or_none(b, E, 2 * E)), 2}};
    case PackedCase::kSeparate:
    default:
      return {
          {at::linear(q, w.narrow(0, 0, E), narrow_or_none(b, 0, E)), 1},
          {at::linear(k, w.narrow(0, E, E), narrow_or_none(b, E, E)), 1},
          {at::linear(v, w.narrow(0, 2 * E, E), narrow_or_none(b, 2 * E, E)), 1}};
  }
}

const char* layout_name(bool batched) {
  return batched ? "batched (3-D)" : "unbatched (2-D)";
}

Tensor pad_last_dim(const Tensor& mask) {
  return mask.defined() ? at::constant_pad_nd(mask, {0, 1}, 0) : mask;
}

// Appends one position to (N, H, len, head_dim) from `row` (bias_k or bias_v) of shape
// (1, 1, E) = (1, 1, H * head_dim).
Tensor append_position(const Tensor& heads, const Tensor& row) {
  const int64_t N = heads.size(0), H = heads.size(1), head_dim = heads.size(3);
  return at::cat({heads, row.reshape({1, H, 1, head_dim}).expand({N, H, 1, head_dim})}, 2);
}

bool on_fast_path_device(const Tensor& t) {
  const auto type = t.device().type();
  return type == at::kCPU || type == at::kCUDA || type == at::kPrivateUse1;
}

bool needs_grad(const std::optional<Tensor>& t) {
  return is_present(t) && t->requires_grad();
}

// torch.nn.MultiheadAttention's conditions for torch._native_multi_head_attention (the fused
// inference path), less the ones only Python can see (fast path switch, tracing), which the
// caller folds into `allow_fast_path`.
bool fast_path_applies(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    int64_t num_heads,
    const std::optional<Tensor>& in_proj_weight,
    const std::optional<Tensor>& in_proj_bias,
    const std::optional<Tensor>& bias_k,
    const std::optional<Tensor>& bias_v,
    bool add_zero_attn,
    const Tensor& out_proj_weight,
    const std::optional<Tensor>& out_proj_bias,
    bool training,
    const Tensor& key_padding_mask,
    const Tensor& attn_mask,
    bool need_weights,
    bool batch_first) {
  if (!(query.dim() == 3 && batch_first && !training && query.is_same(key) && key.is_same(value))) {
    return false;
  }
  if (!is_present(in_proj_weight) || !is_present(in_proj_bias) || is_present(bias_k) ||
      is_present(bias_v) || add_zero_attn || num_heads % 2 != 0) {
    return false;
  }
  if (query.scalar_type() != in_proj_weight->scalar_type() ||
      query.scalar_type() != in_proj_bias->scalar_type()) {
    return false;
  }
  // Float masks are not supported there; bool masks are.
  if ((attn_mask.defined() && attn_mask.is_floating_point()) ||
      (key_padding_mask.defined() && key_padding_mask.is_floating_point())) {
    return false;
  }
  if (query.is_nested() || at::autocast::is_autocast_enabled(query.device().type())) {
    return false;
  }
  // Without weights and masks our SDPA path gives torch's numbers (no fully masked rows can
  // differ) and is faster than the fused kernel, which does not use flash attention on CPU.
  if (!need_weights && !key_padding_mask.defined() && !attn_mask.defined()) {
    return false;
  }
  for (const Tensor* t : {&query, &*in_proj_weight, &*in_proj_bias, &out_proj_weight}) {
    if (!on_fast_path_device(*t)) {
      return false;
    }
  }
  if (is_present(out_proj_bias) && !on_fast_path_device(*out_proj_bias)) {
    return false;
  }
  if (c10::GradMode::is_enabled() &&
      (query.requires_grad() || needs_grad(in_proj_weight) || needs_grad(in_proj_bias) ||
       out_proj_weight.requires_grad() || needs_grad(out_proj_bias))) {
    return false;
  }
  return true;
}

}  // namespace

std::vector<Tensor> in_projection_packed(
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const Tensor& w,
    const std::optional<Tensor>& b) {
  const int64_t E = q.size(-1);
  TORCH_CHECK(
      k.size(-1) == E && v.size(-1) == E,
      "in_projection_packed: q, k and v must share the embedding size, but got q of shape ",
      q.sizes(), ", k of shape ", k.sizes(), " and v of shape ", v.sizes());
  std::vector<Tensor> projections;
  for (const auto& group : packed_projection_gemms(q, k, v, w, b, packed_case(q, k, v))) {
    for (auto& part : group.output.chunk(group.parts, -1)) {  // views into the GEMM's output
      projections.push_back(std::move(part));
    }
  }
  return projections;
}

std::vector<Tensor> in_projection(
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const Tensor& w_q,
    const Tensor& w_k,
    const Tensor& w_v,
    const std::optional<Tensor>& b_q,
    const std::optional<Tensor>& b_k,
    const std::optional<Tensor>& b_v) {
  const int64_t Eq = q.size(-1), Ek = k.size(-1), Ev = v.size(-1);
  auto check_weight = [&](const Tensor& w, int64_t in_features, const char* name) {
    TORCHMHA_CHECK_ARG(
        w.dim() == 2 && w.size(0) == Eq && w.size(1) == in_features, "expected ", name,
        " of shape (", Eq, ", ", in_features, "), but got ", w.sizes());
  };
  auto check_bias = [&](const std::optional<Tensor>& b, const char* name) {
    TORCHMHA_CHECK_ARG(
        !is_present(b) || (b->dim() == 1 && b->size(0) == Eq), "expected ", name,
        " of shape (", Eq, ",), but got ", b->sizes());
  };
  check_weight(w_q, Eq, "query weight (w_q)");
  check_weight(w_k, Ek, "key weight (w_k)");
  check_weight(w_v, Ev, "value weight (w_v)");
  check_bias(b_q, "query bias (b_q)");
  check_bias(b_k, "key bias (b_k)");
  check_bias(b_v, "value bias (b_v)");
  return {at::linear(q, w_q, b_q), at::linear(k, w_k, b_k), at::linear(v, w_v, b_v)};
}

std::tuple<Tensor, Tensor> multi_head_attention_forward(
    const Tensor& query_in,
    const Tensor& key_in,
    const Tensor& value_in,
    int64_t embed_dim,
    int64_t num_heads,
    const std::optional<Tensor>& in_proj_weight,
    const std::optional<Tensor>& in_proj_bias,
    const std::optional<Tensor>& bias_k,
    const std::optional<Tensor>& bias_v,
    bool add_zero_attn,
    double dropout_p,
    const Tensor& out_proj_weight,
    const std::optional<Tensor>& out_proj_bias,
    bool training,
    const std::optional<Tensor>& key_padding_mask_in,
    bool need_weights,
    const std::optional<Tensor>& attn_mask_in,
    const std::optional<Tensor>& q_proj_weight,
    const std::optional<Tensor>& k_proj_weight,
    const std::optional<Tensor>& v_proj_weight,
    bool average_attn_weights,
    bool is_causal,
    bool batch_first,
    bool allow_fast_path) {
  TORCH_CHECK_VALUE(
      embed_dim > 0 && num_heads > 0, "embed_dim and num_heads must be greater than 0, got embed_dim=",
      embed_dim, " and num_heads=", num_heads);
  TORCH_CHECK_VALUE(
      dropout_p >= 0.0 && dropout_p <= 1.0, "dropout probability has to be between 0 and 1, but got ",
      dropout_p);
  const Tensor kpm_raw = is_present(key_padding_mask_in) ? *key_padding_mask_in : Tensor();
  const Tensor mask_raw = is_present(attn_mask_in) ? *attn_mask_in : Tensor();

  // Checks run in torch's order, so a call with several faults raises the exception torch raises.
  // --- masks first, as torch.nn.MultiheadAttention: bool or float only; bool -> additive float.
  Tensor kpm = canonical_mask(kpm_raw, "key_padding_mask", query_in.scalar_type());
  Tensor attn_mask = canonical_mask(mask_raw, "attn_mask", query_in.scalar_type());

  // --- ranks: batched (3-D) or unbatched (2-D), with matching keys, values and masks.
  const int64_t rank = query_in.dim();
  TORCHMHA_CHECK_ARG(
      rank == 2 || rank == 3, "query should be unbatched 2-D or batched 3-D, but got a ", rank,
      "-D query of shape ", query_in.sizes());
  const bool batched = rank == 3;
  TORCHMHA_CHECK_ARG(
      key_in.dim() == rank && value_in.dim() == rank, "for ", layout_name(batched), " query of shape ",
      query_in.sizes(), ", expected key and value to be ", rank, "-D, but got key of shape ",
      key_in.sizes(), " and value of shape ", value_in.sizes());
  TORCHMHA_CHECK_ARG(
      !kpm_raw.defined() || kpm_raw.dim() == rank - 1, "for ", layout_name(batched),
      " query, expected key_padding_mask to be None or ", rank - 1, "-D, but got key_padding_mask of shape ",
      kpm_raw.sizes());
  TORCHMHA_CHECK_ARG(
      !mask_raw.defined() || mask_raw.dim() == 2 || mask_raw.dim() == 3, "for ", layout_name(batched),
      " query, expected attn_mask to be None, 2-D or 3-D, but got attn_mask of shape ",
      mask_raw.sizes());

  if (!batched && mask_raw.defined() && mask_raw.dim() == 3) {
    TORCHMHA_CHECK_ARG(
        mask_raw.size(0) == num_heads && mask_raw.size(1) == query_in.size(0) &&
            mask_raw.size(2) == key_in.size(0),
        "for unbatched (2-D) query, expected a 3-D attn_mask of shape (", num_heads, ", ",
        query_in.size(0), ", ", key_in.size(0), ") (num_heads, L, S), but got ", mask_raw.sizes());
  }

  // Layout: sequence and batch dimensions of query/key/value once batched.
  const int64_t batch_dim = batch_first ? 0 : 1;
  const int64_t seq_dim = 1 - batch_dim;
  // Identity decides the packed in-projection case; take it before any reshaping.
  const PackedCase which = packed_case(query_in, key_in, value_in);
  Tensor query = batched ? query_in : query_in.unsqueeze(batch_dim);
  Tensor key = batched ? key_in : key_in.unsqueeze(batch_dim);
  Tensor value = batched ? value_in : value_in.unsqueeze(batch_dim);
  if (!batched && kpm.defined()) {
    kpm = kpm.unsqueeze(0);
  }

  const int64_t tgt_len = query.size(seq_dim);
  const int64_t bsz = query.size(batch_dim);
  const int64_t src_len = key.size(seq_dim);
  // is_causal as torch treats the hint.
  TORCH_CHECK(
      !is_causal || attn_mask.defined(),
      "is_causal=True is a hint that attn_mask is causal and needs attn_mask too; build one with "
      "torch.nn.Transformer.generate_square_subsequent_mask(L)");
  // Without a padding mask or weights, SDPA applies causality itself and the slow path never reads
  // the mask (torch does not even check its shape); the fused fast path still uses it. Otherwise
  // the mask is applied as given (merged with a padding mask it is no longer just causal).
  const bool causal_replaces_mask = is_causal && !kpm.defined() && !need_weights;
  TORCHMHA_CHECK_ARG(
      query.size(2) == embed_dim, "was expecting query of embedding size ", embed_dim,
      ", but got query of shape ", query_in.sizes());
  TORCHMHA_CHECK_ARG(
      embed_dim % num_heads == 0, "embed_dim ", embed_dim, " is not divisible by num_heads ", num_heads);
  const int64_t head_dim = embed_dim / num_heads;
  const bool separate_weights = !is_present(in_proj_weight);
  if (separate_weights) {
    TORCHMHA_CHECK_ARG(
        is_present(q_proj_weight) && is_present(k_proj_weight) && is_present(v_proj_weight),
        "without in_proj_weight, q_proj_weight, k_proj_weight and v_proj_weight are all needed");
    TORCHMHA_CHECK_ARG(
        key.size(0) == value.size(0) && key.size(1) == value.size(1),
        "key's sequence and batch sizes must match value's, but got key of shape ", key_in.sizes(),
        " and value of shape ", value_in.sizes());
  } else {
    TORCHMHA_CHECK_ARG(
        key.sizes() == value.sizes(), "key shape ", key_in.sizes(), " does not match value shape ",
        value_in.sizes());
  }
  TORCH_CHECK(
      key.size(batch_dim) == bsz, "key and value must have the batch size of query (", bsz,
      "), but got query of shape ", query_in.sizes(), " and key of shape ", key_in.sizes());

  // Mask shapes, checked after the in-projection as torch does (its errors come first there).
  auto check_mask_shapes = [&](bool attn_mask_is_read) {
    if (attn_mask.defined() && attn_mask_is_read) {
      if (attn_mask.dim() == 2) {
        TORCH_CHECK(
            attn_mask.size(0) == tgt_len && attn_mask.size(1) == src_len, "the shape of the 2-D attn_mask is ",
            attn_mask.sizes(), ", but should be (", tgt_len, ", ", src_len, ") (target length, source length)");
      } else {
        TORCH_CHECK(
            attn_mask.size(0) == bsz * num_heads && attn_mask.size(1) == tgt_len &&
                attn_mask.size(2) == src_len,
            "the shape of the 3-D attn_mask is ", attn_mask.sizes(), ", but should be (", bsz * num_heads,
            ", ", tgt_len, ", ", src_len, ") (batch * num_heads, target length, source length)");
      }
    }
    TORCHMHA_CHECK_ARG(
        is_present(bias_k) == is_present(bias_v), "bias_k and bias_v must be given together, but only ",
        is_present(bias_k) ? "bias_k" : "bias_v", " was");
    if (kpm.defined()) {
      TORCHMHA_CHECK_ARG(
          kpm.size(0) == bsz && kpm.size(1) == src_len, "expected key_padding_mask of shape ",
          batched ? c10::str("(", bsz, ", ", src_len, ")") : c10::str("(", src_len, ",)"),
          " (batch, source length), but got ", kpm_raw.sizes());
    }
  };

  if (allow_fast_path &&
      fast_path_applies(
          query_in, key_in, value_in, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v,
          add_zero_attn, out_proj_weight, out_proj_bias, training, kpm_raw, mask_raw, need_weights, batch_first)) {
    check_mask_shapes(/*attn_mask_is_read=*/true);
    // Masks merged as torch.nn.MultiheadAttention.merge_masks does: type 1 = padding only
    // (N, S), type 2 = (N, H, L, S).
    std::optional<int64_t> mask_type;
    Tensor merged;
    if (kpm.defined()) {
      mask_type = 1;
      merged = kpm;
    }
    if (attn_mask.defined()) {
      mask_type = 2;
      merged = attn_mask.dim() == 3
          ? attn_mask.view({bsz, num_heads, tgt_len, src_len})
          : attn_mask.view({1, 1, tgt_len, src_len}).expand({bsz, num_heads, tgt_len, src_len});
      if (kpm.defined()) {
        merged = merged + kpm.view({bsz, 1, 1, src_len});
      }
    }
    return at::_native_multi_head_attention(
        query_in, key_in, value_in, embed_dim, num_heads, *in_proj_weight, *in_proj_bias,
        out_proj_weight, out_proj_bias.value_or(Tensor()),
        merged.defined() ? std::optional<Tensor>(merged) : std::nullopt, need_weights,
        average_attn_weights, mask_type);
  }

  // --- in-projection (packed by identity, or separate weights), as heads (N, H, len, head_dim).
  std::vector<Tensor> qkv;
  auto add_heads = [&](const Tensor& projected, int64_t parts) {
    for (auto& t : to_heads(projected, parts, num_heads, head_dim, batch_first)) {
      qkv.push_back(std::move(t));
    }
  };
  if (separate_weights) {
    std::optional<Tensor> b_q, b_k, b_v;
    if (is_present(in_proj_bias)) {
      auto b = in_proj_bias->chunk(3);
      b_q = b[0], b_k = b[1], b_v = b[2];
    }
    for (const auto& projected :
         in_projection(query, key, value, *q_proj_weight, *k_proj_weight, *v_proj_weight, b_q, b_k, b_v)) {
      add_heads(projected, 1);
    }
  } else {
    for (const auto& group : packed_projection_gemms(query, key, value, *in_proj_weight, in_proj_bias, which)) {
      add_heads(group.output, group.parts);
    }
  }
  Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  check_mask_shapes(/*attn_mask_is_read=*/!causal_replaces_mask);
  if (causal_replaces_mask) {
    attn_mask = Tensor();
  }

  // Masks as 4-D tensors broadcastable to (N, H, L, S): the padding mask stays (N, 1, 1, S),
  // so nothing of size N*H*L*S is built unless a 3-D attn_mask already is that big.
  if (attn_mask.defined()) {
    attn_mask = attn_mask.dim() == 2 ? attn_mask.view({1, 1, tgt_len, src_len})
                                     : attn_mask.view({bsz, num_heads, tgt_len, src_len});
  }
  if (is_present(bias_k)) {
    k = append_position(k, *bias_k);
    v = append_position(v, *bias_v);
    attn_mask = pad_last_dim(attn_mask);
    kpm = pad_last_dim(kpm);
  }
  if (add_zero_attn) {  // one all-zero key/value position: a zero pad of the length dimension
    k = at::constant_pad_nd(k, {0, 0, 0, 1}, 0);
    v = at::constant_pad_nd(v, {0, 0, 0, 1}, 0);
    attn_mask = pad_last_dim(attn_mask);
    kpm = pad_last_dim(kpm);
  }
  const int64_t total_src_len = k.size(2);
  if (kpm.defined()) {
    kpm = kpm.view({bsz, 1, 1, total_src_len});
    attn_mask = attn_mask.defined() ? attn_mask + kpm : kpm;
  }
  // As torch (baddbmm, SDPA): a float mask is added in the query's dtype, not promoted.
  TORCH_CHECK(
      !attn_mask.defined() || attn_mask.scalar_type() == q.scalar_type(), "float masks must have the dtype of query (",
      q.scalar_type(), "), but the attn_mask and key_padding_mask given combine to ", attn_mask.scalar_type());

  const double p = training ? dropout_p : 0.0;

  Tensor attn_output, attn_weights;
  if (need_weights) {
    // Explicit softmax(q k^T / sqrt(head_dim) + mask): the weights are part of the result.
    // bmm over the N*H heads (reshape copies strided heads once; 4-D matmul would add more ops).
    // The 1/sqrt(head_dim) scale is the GEMM's alpha rather than a pass over q (torch scales q;
    // the two agree to rounding, exactly when head_dim is a power of 4). beta = 0 ignores the
    // input, so a zero-stride placeholder serves.
    const int64_t batch_heads = bsz * num_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    auto ignored_input = at::empty({1, 1, 1}, q.options()).expand({batch_heads, tgt_len, total_src_len});
    auto scores = at::baddbmm(
                      ignored_input, q.reshape({batch_heads, tgt_len, head_dim}),
                      k.reshape({batch_heads, total_src_len, head_dim}).transpose(1, 2), /*beta=*/0, /*alpha=*/scale)
                      .view({bsz, num_heads, tgt_len, total_src_len});
    // In place on the GEMM's fresh output (its backward reads only its inputs): spares an
    // N*H*L*S allocation.
    if (attn_mask.defined()) {
      scores.add_(attn_mask);
    }
    attn_weights = at::softmax(scores, -1);
    if (p > 0.0) {
      attn_weights = at::dropout(attn_weights, p, /*train=*/true);
    }
    attn_output = at::bmm(attn_weights.reshape({batch_heads, tgt_len, total_src_len}),
                          v.reshape({batch_heads, total_src_len, head_dim}))
                      .view({bsz, num_heads, tgt_len, head_dim});
    if (average_attn_weights) {
      attn_weights = attn_weights.mean(1);
    }
    if (!batched) {
      attn_weights = attn_weights.squeeze(0);
    }
  } else {
    attn_output = at::scaled_dot_product_attention(
        q, k, v, detail::optional_if_defined(attn_mask), p, /*is_causal=*/causal_replaces_mask);
  }
  auto output = at::linear(merge_heads(attn_output, batch_first), out_proj_weight, out_proj_bias);
  if (!batched) {
    output = output.squeeze(batch_dim);
  }
  return std::make_tuple(output, attn_weights);
}

}  // namespace torchmha
