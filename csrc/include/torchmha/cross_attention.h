#pragma once

// The source article's CrossAttention (its defects removed; see docs/versions.md), on torchmha's core.

#include <torchmha/export.h>
#include <torchmha/kv_cache.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>

namespace torchmha {

/// Options for CrossAttention.
struct CrossAttentionOptions {
  /* implicit */ CrossAttentionOptions(int64_t query_dim) : query_dim_(query_dim) {}
  /// Feature size of the input x and of the output.
  TORCH_ARG(int64_t, query_dim);
  /// Feature size of the context; defaults to query_dim.
  TORCH_ARG(std::optional<int64_t>, context_dim) = std::nullopt;
  /// Number of heads H.
  TORCH_ARG(int64_t, heads) = 8;
  /// Width D of each head; the inner width H * D may differ from query_dim.
  TORCH_ARG(int64_t, dim_head) = 64;
  /// Dropout after the output projection (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
};

/// Cross-attention with its own inner width: to_q Linear(query_dim, H*D), to_k and to_v
/// Linear(context_dim, H*D), all without bias; to_out Linear(H*D, query_dim) then dropout.
/// Scale D^-0.5. Batch first: x (N, L, query_dim), context (N, S, context_dim), defaulting to x.
/// mask (N, S): bool, **true = keep** (the article's convention, the opposite of torch's
/// key_padding_mask). A query whose keys are all masked gets NaN, as in torch.
/// ```
/// torchmha::CrossAttention attn(torchmha::CrossAttentionOptions(64).context_dim(32).heads(4).dim_head(16));
/// auto y = attn(torch::randn({2, 10, 64}), torch::randn({2, 7, 32}));  // (2, 10, 64)
/// ```
class TORCHMHA_API CrossAttentionImpl : public torch::nn::Cloneable<CrossAttentionImpl> {
 public:
  explicit CrossAttentionImpl(const CrossAttentionOptions& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// x (N, L, query_dim); context (N, S, context_dim) or undefined (then x); mask (N, S) or
  /// undefined. Returns (N, L, query_dim).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {}, const at::Tensor& mask = {});
  /// The context's keys and values, (N, H, S, D) each, to reuse across decoding steps.
  StaticKeyValue project_context(const at::Tensor& context);
  /// forward() with the context already projected by project_context().
  at::Tensor forward_with_cache(const at::Tensor& x, const StaticKeyValue& context, const at::Tensor& mask = {});

  CrossAttentionOptions options;
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out{nullptr};
  torch::nn::Dropout dropout{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())}, {2, torch::nn::AnyValue(at::Tensor())})
};
TORCH_MODULE(CrossAttention);

}  // namespace torchmha
