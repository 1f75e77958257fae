#pragma once

// The four versions of the source article (see docs/versions.md), rebuilt without its defects.
// Layout [L, N, E] (sequence, batch, embedding). Scale 1/sqrt(head_dim). Masks follow torch's
// attn_mask convention: (L, S) or (N * num_heads, L, S); bool true = not allowed to attend,
// float = added to the scores. Dropout acts on the attention weights, in training mode only.

#include <torchmha/export.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>

namespace torchmha {

/// Options for MultiheadAttentionV1 (single-head self-attention).
struct MultiheadAttentionV1Options {
  /* implicit */ MultiheadAttentionV1Options(int64_t embed_dim) : embed_dim_(embed_dim) {}
  /// Embedding size E of the input and output.
  TORCH_ARG(int64_t, embed_dim);
};

/// v1: single-head self-attention, softmax(Q K^T / sqrt(E)) V with separate q/k/v/out
/// projections (Linear E -> E each). Equivalent to torch.nn.MultiheadAttention(E, 1).
/// ```
/// torchmha::MultiheadAttentionV1 attn(64);
/// auto y = attn(torch::randn({10, 2, 64}));  // [L, N, E] -> [L, N, E]
/// ```
class TORCHMHA_API MultiheadAttentionV1Impl : public torch::nn::Cloneable<MultiheadAttentionV1Impl> {
 public:
  explicit MultiheadAttentionV1Impl(const MultiheadAttentionV1Options& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// x: [L, N, E] -> [L, N, E].
  at::Tensor forward(const at::Tensor& x);

  MultiheadAttentionV1Options options;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
};
TORCH_MODULE(MultiheadAttentionV1);

/// Options for MultiheadAttentionV2 (multi-head self-attention) and MultiheadAttentionV4.
struct MultiheadAttentionV2Options {
  MultiheadAttentionV2Options(int64_t embed_dim, int64_t num_heads)
      : embed_dim_(embed_dim), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, embed_dim);
  /// Number of heads H; must divide embed_dim.
  TORCH_ARG(int64_t, num_heads);
  /// Dropout probability on the attention weights (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
};

/// v2: multi-head self-attention with attention dropout and an optional attn_mask.
/// Equivalent to torch.nn.MultiheadAttention(E, H, dropout) called as mha(x, x, x, attn_mask=mask).
class TORCHMHA_API MultiheadAttentionV2Impl : public torch::nn::Cloneable<MultiheadAttentionV2Impl> {
 public:
  MultiheadAttentionV2Impl(int64_t embed_dim, int64_t num_heads)
      : MultiheadAttentionV2Impl(MultiheadAttentionV2Options(embed_dim, num_heads)) {}
  explicit MultiheadAttentionV2Impl(const MultiheadAttentionV2Options& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// x: [L, N, E]; attn_mask: undefined, (L, L) or (N*H, L, L). Returns [L, N, E].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& attn_mask = {});

  MultiheadAttentionV2Options options;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())})
};
TORCH_MODULE(MultiheadAttentionV2);

/// Options for MultiheadAttentionV3 (general attention: own key/value sizes and lengths).
struct MultiheadAttentionV3Options {
  MultiheadAttentionV3Options(int64_t embed_dim, int64_t num_heads)
      : embed_dim_(embed_dim), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, embed_dim);
  TORCH_ARG(int64_t, num_heads);
  /// Feature size of the key; defaults to embed_dim.
  TORCH_ARG(std::optional<int64_t>, kdim) = std::nullopt;
  /// Feature size of the value; defaults to embed_dim.
  TORCH_ARG(std::optional<int64_t>, vdim) = std::nullopt;
  TORCH_ARG(double, dropout) = 0.0;
};

/// v3: query [L, N, E], key [S, N, kdim], value [S, N, vdim]; k_proj is Linear(kdim, E) and
/// v_proj Linear(vdim, E). Equivalent to torch.nn.MultiheadAttention(E, H, dropout, kdim=, vdim=).
class TORCHMHA_API MultiheadAttentionV3Impl : public torch::nn::Cloneable<MultiheadAttentionV3Impl> {
 public:
  MultiheadAttentionV3Impl(int64_t embed_dim, int64_t num_heads)
      : MultiheadAttentionV3Impl(MultiheadAttentionV3Options(embed_dim, num_heads)) {}
  explicit MultiheadAttentionV3Impl(const MultiheadAttentionV3Options& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// attn_mask: undefined, (L, S) or (N*H, L, S). Returns [L, N, E].
  at::Tensor forward(
      const at::Tensor& query,
      const at::Tensor& key,
      const at::Tensor& value,
      const at::Tensor& attn_mask = {});

  MultiheadAttentionV3Options options;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(at::Tensor())})
};
TORCH_MODULE(MultiheadAttentionV3);

/// v4 (packed in-projection) takes v2's options: embed_dim, num_heads, dropout.
using MultiheadAttentionV4Options = MultiheadAttentionV2Options;

/// v4: one packed in_proj = Linear(E, 3E) (rows q, k, v: exactly torch's in_proj_weight) and
/// out_proj. Projects through in_projection_packed, so self-attention (query, key and value the
/// same tensor), encoder-decoder attention (key the same tensor as value) and general attention
/// all work. Inputs [L, N, E], [S, N, E], [S, N, E].
class TORCHMHA_API MultiheadAttentionV4Impl : public torch::nn::Cloneable<MultiheadAttentionV4Impl> {
 public:
  MultiheadAttentionV4Impl(int64_t embed_dim, int64_t num_heads)
      : MultiheadAttentionV4Impl(MultiheadAttentionV4Options(embed_dim, num_heads)) {}
  explicit MultiheadAttentionV4Impl(const MultiheadAttentionV4Options& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(
      const at::Tensor& query,
      const at::Tensor& key,
      const at::Tensor& value,
      const at::Tensor& attn_mask = {});

  MultiheadAttentionV4Options options;
  torch::nn::Linear in_proj{nullptr}, out_proj{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(at::Tensor())})
};
TORCH_MODULE(MultiheadAttentionV4);

}  // namespace torchmha
