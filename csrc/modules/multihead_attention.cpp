// torchmha::MultiheadAttention (multihead_attention.h): parameters as torch's, and one call into
// the functional core per method.

#include <torchmha/functional.h>
#include <torchmha/multihead_attention.h>

#include "core/checks.h"
#include "core/common.h"

#include <torch/nn/init.h>

namespace torchmha {

using at::Tensor;
using torch::nn::Linear;
using torch::nn::LinearOptions;

MultiheadAttentionImpl::MultiheadAttentionImpl(const MultiheadAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionImpl::reset() {
  const int64_t E = options.embed_dim();
  core::check_module_sizes(E, options.num_heads(), options.kdim().value_or(E), options.vdim().value_or(E));
  const int64_t kdim = options.kdim().value_or(E);
  const int64_t vdim = options.vdim().value_or(E);
  head_dim = E / options.num_heads();
  qkv_same_embed_dim = kdim == E && vdim == E;
  // Registration order and names as torch.nn.MultiheadAttention, so state dicts line up; absent
  // parameters are registered undefined, as torch registers None.
  auto param = [&](const char* name, at::IntArrayRef shape, bool present) {
    return register_parameter(name, present ? torch::empty(shape) : Tensor(), /*requires_grad=*/present);
  };
  in_proj_weight = param("in_proj_weight", {3 * E, E}, qkv_same_embed_dim);
  q_proj_weight = param("q_proj_weight", {E, E}, !qkv_same_embed_dim);
  k_proj_weight = param("k_proj_weight", {E, kdim}, !qkv_same_embed_dim);
  v_proj_weight = param("v_proj_weight", {E, vdim}, !qkv_same_embed_dim);
  in_proj_bias = param("in_proj_bias", {3 * E}, options.bias());
  // out_proj's own initialisation draws from the RNG before reset_parameters, as in torch.
  out_proj = register_module("out_proj", Linear(LinearOptions(E, E).bias(options.bias())));
  bias_k = param("bias_k", {1, 1, E}, options.add_bias_kv());
  bias_v = param("bias_v", {1, 1, E}, options.add_bias_kv());
  reset_parameters();
}

void MultiheadAttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (qkv_same_embed_dim) {
    torch::nn::init::xavier_uniform_(in_proj_weight);
  } else {
    torch::nn::init::xavier_uniform_(q_proj_weight);
    torch::nn::init::xavier_uniform_(k_proj_weight);
    torch::nn::init::xavier_uniform_(v_proj_weight);
  }
  if (in_proj_bias.defined()) {
    in_proj_bias.zero_();
    out_proj->bias.zero_();
  }
  if (bias_k.defined()) {
    torch::nn::init::xavier_normal_(bias_k);
    torch::nn::init::xavier_normal_(bias_v);
  }
}

void MultiheadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::MultiheadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads() << ", dropout=" << options.dropout()
         << ", bias=" << options.bias() << ", add_bias_kv=" << options.add_bias_kv()
         << ", add_zero_attn=" << options.add_zero_attn()
         << ", kdim=" << options.kdim().value_or(options.embed_dim())
         << ", vdim=" << options.vdim().value_or(options.embed_dim())
         << ", batch_first=" << options.batch_first() << ")";
}

AttentionParameters MultiheadAttentionImpl::attention_parameters() const {
  AttentionParameters params;
  params.num_heads = options.num_heads();
  params.in_proj_weight = optional_if_defined(in_proj_weight);
  params.in_proj_bias = optional_if_defined(in_proj_bias);
  params.q_proj_weight = optional_if_defined(q_proj_weight);
  params.k_proj_weight = optional_if_defined(k_proj_weight);
  params.v_proj_weight = optional_if_defined(v_proj_weight);
  params.bias_k = optional_if_defined(bias_k);
  params.bias_v = optional_if_defined(bias_v);
  params.add_zero_attn = options.add_zero_attn();
  params.out_proj_weight = out_proj->weight;
  params.out_proj_bias = optional_if_defined(out_proj->bias);
  return params;
}

DecodingOptions MultiheadAttentionImpl::decoding_options(const Tensor& key_padding_mask) const {
  return {optional_if_defined(key_padding_mask), options.dropout(), is_training(), options.batch_first()};
}

std::tuple<Tensor, Tensor> MultiheadAttentionImpl::forward(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const Tensor& key_padding_mask,
    bool need_weights,
    const Tensor& attn_mask,
    bool average_attn_weights,
    bool is_causal) {
  core::warn_if_mask_dtypes_differ(optional_if_defined(key_padding_mask), optional_if_defined(attn_mask));
  AttentionOptions call;
  call.key_padding_mask = optional_if_defined(key_padding_mask);
  call.attn_mask = optional_if_defined(attn_mask);
  call.need_weights = need_weights;
  call.average_attn_weights = average_attn_weights;
  call.is_causal = is_causal;
  call.training = is_training();
  call.batch_first = options.batch_first();
  call.dropout_p = options.dropout();
  call.allow_fast_path = fast_path_enabled();
  return multi_head_attention_forward(query, key, value, options.embed_dim(), attention_parameters(), call);
}

// ---------------------------------------------------------------------------------- decoding

Tensor MultiheadAttentionImpl::forward_with_cache(const Tensor& query, KeyValueCache& cache, const Tensor& key_padding_mask,
                                                  const Tensor& new_lengths) {
  return attention_with_cache(query, cache.keys(), cache.values(), cache.lengths(), attention_parameters(),
                              decoding_options(key_padding_mask), optional_if_defined(new_lengths));
}

Tensor MultiheadAttentionImpl::forward_with_cache(
    const Tensor& query,
    const StaticKeyValue& memory,
    const Tensor& key_padding_mask) {
  return attention_with_static_key_value(query, memory.keys, memory.values, attention_parameters(),
                                         decoding_options(key_padding_mask));
}

StaticKeyValue MultiheadAttentionImpl::project_key_value(const Tensor& key, const Tensor& value) {
  auto [keys, values] =
      torchmha::project_key_value(key, optional_if_defined(value), attention_parameters(), options.batch_first());
  return {keys, values};
}

}  // namespace torchmha
