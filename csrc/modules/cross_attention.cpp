// CrossAttention (cross_attention.h): parameters, and one call into the functional core.

#include <torchmha/cross_attention.h>
#include <torchmha/functional.h>

#include "core/common.h"
#include "core/layers.h"

namespace torchmha {

using at::Tensor;

CrossAttentionImpl::CrossAttentionImpl(const CrossAttentionOptions& options_) : options(options_) {
  reset();
}

void CrossAttentionImpl::reset() {
  const int64_t query_dim = options.query_dim();
  const int64_t context_dim = options.context_dim().value_or(query_dim);
  core::check_cross_attention_sizes(query_dim, context_dim, options.heads(), options.dim_head());
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
  AttentionParameters params;
  params.num_heads = options.heads();
  params.k_proj_weight = to_k->weight;
  params.v_proj_weight = to_v->weight;
  auto [keys, values] = project_key_value(context, std::nullopt, params, /*batch_first=*/true);
  return {keys, values};
}

Tensor CrossAttentionImpl::forward_with_cache(const Tensor& x, const StaticKeyValue& context, const Tensor& mask) {
  AttentionParameters params;
  params.num_heads = options.heads();
  params.q_proj_weight = to_q->weight;
  params.out_proj_weight = to_out->weight;
  params.out_proj_bias = optional_if_defined(to_out->bias);
  return dropout(cross_attention(x, context.keys, context.values, params, optional_if_defined(mask), is_training()));
}

}  // namespace torchmha
