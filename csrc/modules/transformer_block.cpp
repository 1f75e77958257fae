// TransformerBlock (transformer_block.h): parameters, and one call into the functional core.

#include <torchmha/functional.h>
#include <torchmha/transformer_block.h>

#include "core/checks.h"
#include "core/common.h"
#include "core/layers.h"

namespace torchmha {

using at::Tensor;

TransformerBlockImpl::TransformerBlockImpl(const TransformerBlockOptions& options_) : options(options_) {
  reset();
}

void TransformerBlockImpl::reset() {
  const int64_t E = options.embed_dim();
  core::check_forward_expansion(options.forward_expansion());
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
  core::warn_if_mask_dtypes_differ(optional_if_defined(key_padding_mask), optional_if_defined(attn_mask));
  FeedForwardParameters feed_forward{linear1->weight, optional_if_defined(linear1->bias), linear2->weight,
                                     optional_if_defined(linear2->bias), norm1->weight, norm1->bias, norm2->weight,
                                     norm2->bias, options.layer_norm_eps(), dropout->options.p(), options.norm_first()};
  BlockOptions call;
  call.attn_mask = optional_if_defined(attn_mask);
  call.key_padding_mask = optional_if_defined(key_padding_mask);
  call.training = is_training();
  call.dropout_p = self_attn->options.dropout();
  call.allow_fast_path = fast_path_enabled();
  return transformer_block(x, feed_forward, self_attn->attention_parameters(), call);
}

}  // namespace torchmha
