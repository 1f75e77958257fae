#pragma once

// torchmha::MultiheadAttention: torch.nn.MultiheadAttention's whole API in C++ (batch_first,
// is_causal, unbatched input, 2-D and 3-D bool or float masks, kdim != vdim, packing decided by
// tensor identity, SDPA when weights are not needed, and the fused inference fast path).

#include <torchmha/attention_arguments.h>
#include <torchmha/export.h>
#include <torchmha/kv_cache.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <tuple>

namespace torchmha {

/// Options for MultiheadAttention; the same as torch.nn.MultiheadAttention's constructor.
struct MultiheadAttentionOptions {
  MultiheadAttentionOptions(int64_t embed_dim, int64_t num_heads)
      : embed_dim_(embed_dim), num_heads_(num_heads) {}
  /// Total dimension E of the model.
  TORCH_ARG(int64_t, embed_dim);
  /// Number of parallel heads; must divide embed_dim.
  TORCH_ARG(int64_t, num_heads);
  /// Dropout probability on the attention weights (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
  /// Bias in the input and output projections.
  TORCH_ARG(bool, bias) = true;
  /// Learned bias_k, bias_v (1, 1, E) appended to keys and values along the sequence.
  TORCH_ARG(bool, add_bias_kv) = false;
  /// Append a zero key and value along the sequence.
  TORCH_ARG(bool, add_zero_attn) = false;
  /// Feature sizes of key and value; default embed_dim.
  TORCH_ARG(std::optional<int64_t>, kdim) = std::nullopt;
  TORCH_ARG(std::optional<int64_t>, vdim) = std::nullopt;
  /// Inputs and outputs (N, L, E) instead of (L, N, E).
  TORCH_ARG(bool, batch_first) = false;
};

/// Multi-head attention with the semantics, parameter names and initialisation of
/// torch.nn.MultiheadAttention. Parameters: in_proj_weight (3E, E) when kdim == vdim == E, else
/// q_proj_weight (E, E), k_proj_weight (E, kdim), v_proj_weight (E, vdim); in_proj_bias (3E);
/// bias_k, bias_v (1, 1, E) with add_bias_kv; out_proj (Linear E -> E).
///
/// forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
/// is_causal) returns {output, weights}: output like query with last dim E; weights (N, L, S)
/// averaged or (N, H, L, S), undefined when need_weights is false.
/// ```
/// torchmha::MultiheadAttention mha(
///     torchmha::MultiheadAttentionOptions(512, 8).batch_first(true).dropout(0.1));
/// auto x = torch::randn({4, 100, 512});
/// auto causal = torch::ones({100, 100}, torch::kBool).triu(1);
/// // forward, not mha(...): ModuleHolder's operator() cannot deduce a braced {} argument.
/// auto [y, w] = mha->forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/false, causal,
///                            /*average_attn_weights=*/true, /*is_causal=*/true);
/// ```
class TORCHMHA_API MultiheadAttentionImpl : public torch::nn::Cloneable<MultiheadAttentionImpl> {
 public:
  MultiheadAttentionImpl(int64_t embed_dim, int64_t num_heads)
      : MultiheadAttentionImpl(MultiheadAttentionOptions(embed_dim, num_heads)) {}
  explicit MultiheadAttentionImpl(const MultiheadAttentionOptions& options);

  std::tuple<at::Tensor, at::Tensor> forward(
      const at::Tensor& query,
      const at::Tensor& key,
      const at::Tensor& value,
      const at::Tensor& key_padding_mask = {},
      bool need_weights = true,
      const at::Tensor& attn_mask = {},
      bool average_attn_weights = true,
      bool is_causal = false);

  /// Incremental causal self-attention (kv_cache.h): query (T, N, E) or (N, T, E) holds up to T
  /// next positions per sequence. Sequence n appends its first new_lengths[n] (default: all T) at
  /// its own cache.lengths()[n], and each attends to its own cached positions up to itself;
  /// output rows past new_lengths[n] are zeros. key_padding_mask (N, S) masks cache positions
  /// [0, S) (left-padded prompts), S covering every filled position. Equals forward() with a
  /// causal mask over each sequence alone. Needs no bias_k/bias_v and no add_zero_attn.
  at::Tensor forward_with_cache(const at::Tensor& query, KeyValueCache& cache, const at::Tensor& key_padding_mask = {},
                                const at::Tensor& new_lengths = {});
  /// Attention to a fixed memory projected once by project_key_value() (the cross-attention
  /// cache): equals forward(query, key, value, key_padding_mask) without recomputing k and v.
  at::Tensor forward_with_cache(
      const at::Tensor& query,
      const StaticKeyValue& memory,
      const at::Tensor& key_padding_mask = {});
  /// Projects key (S, N, kdim) and value (S, N, vdim) (batch_first: (N, S, *)) into heads once;
  /// value defaults to key.
  StaticKeyValue project_key_value(const at::Tensor& key, const at::Tensor& value = {});

  /// The module's parameters as the functional API takes them (absent ones std::nullopt).
  AttentionParameters attention_parameters() const;
  /// A decoding call's options: the module's dropout, mode and layout, and key_padding_mask.
  DecodingOptions decoding_options(const at::Tensor& key_padding_mask = {}) const;

  /// Registers every parameter and out_proj, then reset_parameters().
  void reset() override;
  /// torch's initialisation, in torch's order (xavier_uniform_ in-projection, zero biases,
  /// xavier_normal_ bias_k and bias_v); out_proj's Linear initialisation runs first, in reset().
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  MultiheadAttentionOptions options;
  int64_t head_dim = 0;
  /// kdim == vdim == embed_dim: one packed in_proj_weight.
  bool qkv_same_embed_dim = true;
  at::Tensor in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight;
  at::Tensor in_proj_bias, bias_k, bias_v;
  torch::nn::Linear out_proj{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS(
      {3, torch::nn::AnyValue(at::Tensor())},
      {4, torch::nn::AnyValue(true)},
      {5, torch::nn::AnyValue(at::Tensor())},
      {6, torch::nn::AnyValue(true)},
      {7, torch::nn::AnyValue(false)})
};
TORCH_MODULE(MultiheadAttention);

}  // namespace torchmha
