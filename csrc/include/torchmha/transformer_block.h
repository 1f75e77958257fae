#pragma once

// The source article's Transformer block (see docs/versions.md) on torchmha's attention.

#include <torchmha/export.h>
#include <torchmha/multihead_attention.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

namespace torchmha {

/// Options for TransformerBlock.
struct TransformerBlockOptions {
  TransformerBlockOptions(int64_t embed_dim, int64_t num_heads) : embed_dim_(embed_dim), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, embed_dim);
  TORCH_ARG(int64_t, num_heads);
  /// Dropout on the attention weights and on each sublayer's output (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
  /// Hidden width of the feed-forward network = forward_expansion * embed_dim.
  TORCH_ARG(int64_t, forward_expansion) = 4;
  /// Pre-norm (LayerNorm before each sublayer) instead of the article's post-norm.
  TORCH_ARG(bool, norm_first) = false;
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
};

/// The article's Transformer block, batch first (N, L, E) -> (N, L, E): self-attention and a
/// feed-forward network Linear(E, F) - ReLU - Linear(F, E), each with a residual connection and
/// LayerNorm, post-norm by default or pre-norm with norm_first. Submodule names and dropout
/// placement are torch.nn.TransformerEncoderLayer's (self_attn, linear1, linear2, norm1, norm2),
/// so with the same weights it computes the same function.
class TORCHMHA_API TransformerBlockImpl : public torch::nn::Cloneable<TransformerBlockImpl> {
 public:
  TransformerBlockImpl(int64_t embed_dim, int64_t num_heads)
      : TransformerBlockImpl(TransformerBlockOptions(embed_dim, num_heads)) {}
  explicit TransformerBlockImpl(const TransformerBlockOptions& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// x (N, L, E); attn_mask (L, L) or (N*H, L, L) and key_padding_mask (N, L) as in
  /// torch.nn.MultiheadAttention (bool true = not allowed). Returns (N, L, E).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& attn_mask = {}, const at::Tensor& key_padding_mask = {});

  TransformerBlockOptions options;
  MultiheadAttention self_attn{nullptr};
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Dropout dropout{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())}, {2, torch::nn::AnyValue(at::Tensor())})
};
TORCH_MODULE(TransformerBlock);

}  // namespace torchmha
