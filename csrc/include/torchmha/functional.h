#pragma once

// The functional core of torchmha: every module (C++ and Python) and every registered op calls
// these functions. They are written in differentiable ATen ops only, so autograd, every device
// ATen supports, fake tensors and torch.compile work without hand-written kernels.

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace torchmha {

/// Projects query, key and value with one packed weight `w` of shape (3E, E) (rows q, k, v)
/// and an optional packed bias of shape (3E). Reproduces the three cases of
/// torch.nn.functional._in_projection_packed, chosen by tensor identity (not by value):
///  - q, k and v are the same tensor (self-attention): one matmul with `w`, then split;
///  - only k and v are the same tensor (encoder-decoder): q with w[:E], k and v with w[E:];
///  - otherwise three separate projections.
/// Shapes: q (..., E), k (..., E), v (..., E) -> {q' (..., E), k' (..., E), v' (..., E)}.
std::vector<at::Tensor> in_projection_packed(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& w,
    const std::optional<at::Tensor>& b = std::nullopt);

/// Projects query, key and value with separate weights, as torch.nn.functional._in_projection:
/// w_q (Eq, Eq), w_k (Eq, Ek), w_v (Eq, Ev), biases (Eq). Returns {q' (..., Eq), k' (..., Eq),
/// v' (..., Eq)}. Weight and bias shapes are checked (ArgumentError naming the argument).
std::vector<at::Tensor> in_projection(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& w_q,
    const at::Tensor& w_k,
    const at::Tensor& w_v,
    const std::optional<at::Tensor>& b_q = std::nullopt,
    const std::optional<at::Tensor>& b_k = std::nullopt,
    const std::optional<at::Tensor>& b_v = std::nullopt);

/// Multi-head attention with the semantics of torch.nn.MultiheadAttention.forward (and of
/// torch.nn.functional.multi_head_attention_forward), including the module's batch_first
/// handling and, when `allow_fast_path` is set, its fused inference fast path.
///
/// Shapes (E = embed_dim, H = num_heads, L target length, S source length, N batch):
///  - query (L, N, E) or (N, L, E) with batch_first, or unbatched (L, E);
///  - key (S, N, kdim), value (S, N, vdim) in the same layout as query;
///  - key_padding_mask (N, S) or (S) unbatched; attn_mask (L, S) or (N*H, L, S);
///    bool masks: true = not allowed to attend; float masks are added to the scores.
///  - in-projection: packed `in_proj_weight` (3E, E), or, when it is absent, separate
///    q_proj_weight (E, E), k_proj_weight (E, kdim), v_proj_weight (E, vdim);
///    in_proj_bias (3E) in both cases; bias_k, bias_v (1, 1, E).
/// Returns {output (like query, last dim E), weights}. weights is (N, L, S) averaged over heads,
/// (N, H, L, S) otherwise, without N for unbatched input, and an undefined tensor when
/// need_weights is false (then the L x S weights are never materialized: SDPA computes the output).
/// is_causal is a hint that attn_mask is causal; it needs attn_mask, as in torch.
std::tuple<at::Tensor, at::Tensor> multi_head_attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    int64_t embed_dim,
    int64_t num_heads,
    const std::optional<at::Tensor>& in_proj_weight,
    const std::optional<at::Tensor>& in_proj_bias,
    const std::optional<at::Tensor>& bias_k,
    const std::optional<at::Tensor>& bias_v,
    bool add_zero_attn,
    double dropout_p,
    const at::Tensor& out_proj_weight,
    const std::optional<at::Tensor>& out_proj_bias,
    bool training = true,
    const std::optional<at::Tensor>& key_padding_mask = std::nullopt,
    bool need_weights = true,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    const std::optional<at::Tensor>& q_proj_weight = std::nullopt,
    const std::optional<at::Tensor>& k_proj_weight = std::nullopt,
    const std::optional<at::Tensor>& v_proj_weight = std::nullopt,
    bool average_attn_weights = true,
    bool is_causal = false,
    bool batch_first = false,
    bool allow_fast_path = false);

/// Internal helpers of the functional core, shared with the decoding code (csrc/decoding.cpp);
/// not part of the stable API.
namespace detail {
/// An undefined tensor (LibTorch's "absent") as std::nullopt, for the optional arguments above.
inline std::optional<at::Tensor> optional_if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
/// Bool masks (true = not allowed) become additive float masks of `target_dtype` (-inf where
/// true); float masks pass through; other dtypes throw ArgumentError naming `name`.
at::Tensor canonical_mask(const at::Tensor& mask, const char* name, at::ScalarType target_dtype);
/// (len, N, parts*E) or, with batch_first, (N, len, parts*E) -> `parts` tensors
/// (N, H, len, head_dim), as strided views (no copy).
std::vector<at::Tensor> to_heads(
    const at::Tensor& x, int64_t parts, int64_t num_heads, int64_t head_dim, bool batch_first);
/// (N, H, len, head_dim) -> (len, N, H * head_dim) or, with batch_first, (N, len, H * head_dim).
at::Tensor merge_heads(const at::Tensor& x, bool batch_first);
}  // namespace detail

}  // namespace torchmha
