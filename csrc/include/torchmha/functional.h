#pragma once

// The functional API: every module (C++ and Python) and every registered op (torch.ops.torchmha.*)
// is one of these calls. They are written in differentiable ATen ops only, so autograd, every
// device ATen supports, fake tensors and torch.compile work without hand-written kernels.
//
// Shapes: E = embed_dim, H = num_heads, D = head_dim, L target length, S source length, N batch,
// T new positions, M cache capacity. Query layouts follow batch_first: (L, N, E) or (N, L, E).
// A module's parameters come as AttentionParameters, a call's masks and flags as AttentionOptions
// or DecodingOptions (attention_arguments.h): the op schemas are written from those structs.

#include <torchmha/attention_arguments.h>
#include <torchmha/export.h>

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace torchmha {

/// Whether the C++ modules (MultiheadAttention, TransformerBlock) take torch's fused inference
/// path (torch._native_multi_head_attention) where torch would: the C++ counterpart of Python's
/// torch.backends.mha.set_fastpath_enabled, process-wide, true by default. (Bound into Python as
/// torchmha.cpp, they follow torch.backends.mha's switch instead.)
TORCHMHA_API void set_fast_path_enabled(bool enabled);
TORCHMHA_API bool fast_path_enabled();

/// torch.nn.functional._in_projection_packed: q, k, v through one packed weight `w` (3E, E)
/// (rows q, k, v) and bias `b` (3E). The case is chosen by tensor identity, never by value:
/// q, k and v one tensor (self-attention): one GEMM; only k and v (encoder-decoder): two; else three.
/// Returns {q' (..., E), k' (..., E), v' (..., E)}.
TORCHMHA_API std::vector<at::Tensor> in_projection_packed(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& w,
    const std::optional<at::Tensor>& b = std::nullopt);

/// torch.nn.functional._in_projection: separate weights w_q (Eq, Eq), w_k (Eq, Ek), w_v (Eq, Ev)
/// and biases (Eq). Returns {q' (..., Eq), k' (..., Eq), v' (..., Eq)}.
TORCHMHA_API std::vector<at::Tensor> in_projection(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& w_q,
    const at::Tensor& w_k,
    const at::Tensor& w_v,
    const std::optional<at::Tensor>& b_q = std::nullopt,
    const std::optional<at::Tensor>& b_k = std::nullopt,
    const std::optional<at::Tensor>& b_v = std::nullopt);

/// torch.nn.MultiheadAttention.forward (and torch.nn.functional.multi_head_attention_forward),
/// with the module's batch_first handling and, with options.allow_fast_path, its fused inference
/// path: query (L, N, E), key (S, N, kdim), value (S, N, vdim), or (N, *, *) with batch_first, or
/// unbatched (L, E), (S, kdim), (S, vdim); embed_dim is checked against query's E.
/// Returns {output (like query, last dim E), weights}: (N, L, S) averaged over heads, (N, H, L, S)
/// otherwise, without N for unbatched input, undefined when need_weights is false (then the
/// L x S weights are never built: SDPA computes the output).
TORCHMHA_API std::tuple<at::Tensor, at::Tensor> multi_head_attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    int64_t embed_dim,
    const AttentionParameters& params,
    const AttentionOptions& options = {});

// ------------------------------------------------------------------------------------ decoding
// num_heads (and head_dim) split the in-projection (width H * D, which may differ from E) into
// heads. bias_k, bias_v and add_zero_attn are rejected: a cache holds no positions for them.
// Cached keys and values are (N, H, M, D).

/// One step of incremental causal self-attention, each sequence at its own position: query
/// (T, N, E) or (N, T, E) holds up to T next positions per sequence. Sequence n appends its first
/// new_lengths[n] positions (default: all T): their keys and values (one packed GEMM with q) are
/// written in place into k_cache and v_cache at [lengths[n], lengths[n] + new_lengths[n]), query
/// row t (position lengths[n] + t) sees keys 0 .. lengths[n] + t, and lengths[n] grows by
/// new_lengths[n] (in place: lengths (N,) int64 is the cache's own count). Output rows past
/// new_lengths[n] are zeros. options.key_padding_mask (N, S) masks cache positions [0, S); S must
/// cover every filled position. Returns the output in query's layout. Shapes never depend on the
/// lengths, so under torch.compile one graph serves every step.
TORCHMHA_API at::Tensor attention_with_cache(
    const at::Tensor& query,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& lengths,
    const AttentionParameters& params,
    const DecodingOptions& options = {},
    const std::optional<at::Tensor>& new_lengths = std::nullopt);

/// Beam search: sequence i of the cache (k_cache, v_cache and lengths, in place) becomes old
/// sequence indices[i].
TORCHMHA_API void reorder_cache(
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& lengths,
    const at::Tensor& indices);
/// Empties the sequences `slots` (an integer index or a bool mask; every one if absent), so a new
/// sequence can start there while the others go on.
TORCHMHA_API void reset_cache(const at::Tensor& lengths, const std::optional<at::Tensor>& slots = std::nullopt);

/// Projects a fixed memory once: key (S, N, kdim) and value (S, N, vdim) (value defaults to key),
/// or (N, S, *) with batch_first, through the k and v weights. Returns {keys, values}, each
/// (N, H, S, D) and contiguous.
TORCHMHA_API std::tuple<at::Tensor, at::Tensor> project_key_value(
    const at::Tensor& key,
    const std::optional<at::Tensor>& value,
    const AttentionParameters& params,
    bool batch_first = false);

/// Attention of query (T, N, E) or (N, T, E) to keys and values from project_key_value (the
/// cross-attention cache); no causal mask. Returns the output in query's layout.
TORCHMHA_API at::Tensor attention_with_static_key_value(
    const at::Tensor& query,
    const at::Tensor& keys,
    const at::Tensor& values,
    const AttentionParameters& params,
    const DecodingOptions& options = {});

// ------------------------------------------------------------------------- cached generation
// A stack of torch's Transformer layers (nn.TransformerDecoderLayer, or nn.TransformerEncoderLayer
// run causally) decoded with a cache. `params` holds 18 entries per layer, then the final norm's
// weight and bias (absent: nullopt): self_attn in_proj_weight, in_proj_bias, out_proj weight, bias;
// multihead_attn (decoders; absent for encoders) the same four; linear1 weight, bias; linear2
// weight, bias; norm1, norm2, norm3 (decoders) weight, bias. Per layer: activations ("relu",
// "gelu", "gelu_tanh", "silu"), norm_first, and 3 eps (norm1, norm2, norm3); final_norm_eps is
// present when the stack has a final LayerNorm. The state between steps is a DecoderCache
// (attention_arguments.h). int8 weights (quantize_weight's) may stand in any linear weight's slot
// (the attentions' in_proj_weight and out_proj weight, linear1 and linear2 weight), with their
// scales at the same index of `weight_scales` (as long as params; empty when none is int8).

/// One step: tgt (T, N, E) (batch_first: (N, T, E)); sequence n appends its first new_lengths[n]
/// positions (all T if absent) and gets the stack's output there (rows past it are zeros); the
/// caches are written and lengths advanced in place. A model in training mode is refused.
TORCHMHA_API at::Tensor decoder_step(
    const at::Tensor& tgt,
    const c10::List<std::optional<at::Tensor>>& params,
    const DecoderCache& cache,
    int64_t num_heads,
    const std::vector<std::string>& activations,
    const c10::List<bool>& norm_first,
    at::ArrayRef<double> eps,
    std::optional<double> final_norm_eps,
    bool batch_first,
    bool training,
    const std::optional<at::Tensor>& new_lengths = std::nullopt,
    const c10::List<std::optional<at::Tensor>>& weight_scales = c10::List<std::optional<at::Tensor>>());

/// A decoder's memory (S, N, E) (batch_first: (N, S, E)) through every layer's cross-attention
/// once, and its key_padding_mask (bool, true = ignore; or float, added; zeros if absent) as the
/// state's additive padding: {memory_keys, memory_values, memory_padding}.
TORCHMHA_API std::tuple<at::Tensor, at::Tensor, at::Tensor> decoder_memory(
    const at::Tensor& memory,
    const c10::List<std::optional<at::Tensor>>& params,
    int64_t num_heads,
    bool batch_first,
    const std::optional<at::Tensor>& memory_key_padding_mask = std::nullopt,
    const c10::List<std::optional<at::Tensor>>& weight_scales = c10::List<std::optional<at::Tensor>>());

/// {int8 weight, float32 scale (out_features,)}: a floating weight quantized symmetrically per
/// output channel (scale = max|row| / 127), as decoder_step's weight_scales take it.
TORCHMHA_API std::tuple<at::Tensor, at::Tensor> quantize_weight(const at::Tensor& weight);

/// int8 copies of a decoder_step parameter list's linear weights: {weights, weight_scales}, each as
/// long as params, quantize_weight's pair at each linear weight's index and nullopt elsewhere
/// (decoder_step takes params with the int8 weights in those places, and weight_scales).
TORCHMHA_API std::tuple<c10::List<std::optional<at::Tensor>>, c10::List<std::optional<at::Tensor>>>
decoder_quantize(const c10::List<std::optional<at::Tensor>>& params);

/// Beam search: sequence i of every part of the cache becomes old sequence indices[i] (in place).
TORCHMHA_API void decoder_reorder(const DecoderCache& cache, const at::Tensor& indices);

/// Empties the sequences `slots` (a 1-D integer index or bool mask; all if absent). With a new
/// memory (decoder_memory's three tensors for those k sequences, S' <= S positions), their
/// memory becomes it, positions past S' masked.
TORCHMHA_API void decoder_reset(
    const DecoderCache& cache,
    const std::optional<at::Tensor>& slots = std::nullopt,
    const std::optional<at::Tensor>& new_keys = std::nullopt,
    const std::optional<at::Tensor>& new_values = std::nullopt,
    const std::optional<at::Tensor>& new_padding = std::nullopt);

// ------------------------------------------------------------------------------ layers

/// CrossAttention's forward on a projected context (see cross_attention.h): x (N, L, query_dim),
/// keys and values (N, heads, S, dim_head), mask (N, S) bool with true = keep; params hold
/// num_heads, q_proj_weight (to_q) and out_proj (to_out). No dropout (the module applies its own
/// after this).
TORCHMHA_API at::Tensor cross_attention(
    const at::Tensor& x,
    const at::Tensor& keys,
    const at::Tensor& values,
    const AttentionParameters& params,
    const std::optional<at::Tensor>& mask = std::nullopt,
    bool training = false);

/// TransformerBlock's forward (see transformer_block.h), batch first: x (N, L, E); the
/// self-attention's parameters (packed), then the feed-forward network and LayerNorms; the
/// self-attention's masks and flags (dropout_p is the attention's dropout).
TORCHMHA_API at::Tensor transformer_block(
    const at::Tensor& x,
    const FeedForwardParameters& feed_forward,
    const AttentionParameters& attention,
    const BlockOptions& options = {});

}  // namespace torchmha
