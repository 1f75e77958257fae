// torchmha::CachedDecoder and DecoderState (cached_decoder.h): LibTorch's Transformer stacks read
// into decoder_step's flat parameter list on every call, and one functional call per method.

#include <torchmha/cached_decoder.h>

#include <torchmha/functional.h>

#include "core/cached_decoder.h"
#include "core/common.h"

#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <mutex>
#include <string>
#include <variant>
#include <vector>

namespace torchmha {
namespace {

using at::Tensor;
using torch::nn::MultiheadAttentionImpl;
using torch::nn::TransformerDecoderLayerImpl;
using torch::nn::TransformerEncoderLayerImpl;
using Params = c10::List<std::optional<Tensor>>;

constexpr const char* kWho = "CachedDecoder";
// LibTorch's layers build their LayerNorms with the default eps; an encoder layer has no norm3,
// whose slot decoder_step still expects.
constexpr double kAbsentNormEps = 1e-5;

// ------------------------------------------------------------------------------ the layers

// The layers of a stack whose type the constructor checked; checked again here, since a
// ModuleList can be changed after that (a wrong layer is a TypeError, not a crash).
template <typename Layer>
const Layer& layer_at(const torch::nn::ModuleList& layers, size_t i, const char* type_name) {
  const auto& module = (*layers)[i];
  const auto* layer = module->as<Layer>();
  TORCH_CHECK_TYPE(layer != nullptr, kWho, ": layer ", i, " must be a ", type_name, ", not ", module->name());
  return *layer;
}

// Calls fn(layer, i) with each layer as its LibTorch type, so the overloads below pick the
// decoder's or the encoder's parts.
template <typename Fn>
void for_each_layer(const torch::nn::ModuleList& layers, bool decoder, Fn&& fn) {
  for (size_t i = 0; i < layers->size(); ++i) {
    if (decoder) {
      fn(layer_at<TransformerDecoderLayerImpl>(layers, i, "torch::nn::TransformerDecoderLayer"), i);
    } else {
      fn(layer_at<TransformerEncoderLayerImpl>(layers, i, "torch::nn::TransformerEncoderLayer"), i);
    }
  }
}

// The stack's final norm, or nullptr without one (decoder_step computes only a LayerNorm).
const torch::nn::LayerNormImpl* final_layer_norm(const torch::nn::AnyModule& norm) {
  if (norm.is_empty()) {
    return nullptr;
  }
  const auto module = norm.ptr();
  const auto* layer_norm = module->as<torch::nn::LayerNormImpl>();
  TORCH_CHECK_TYPE(layer_norm != nullptr, kWho, ": the final norm must be a torch::nn::LayerNorm, not ",
                   module->name());
  return layer_norm;
}

// decoder_step's name for a layer's activation. A std::function is opaque: the step cannot tell
// what it computes, so it is refused rather than guessed.
std::string activation_name(const torch::nn::activation_t& activation) {
  if (std::holds_alternative<torch::enumtype::kReLU>(activation)) {
    return "relu";
  }
  if (std::holds_alternative<torch::enumtype::kGELU>(activation)) {
    return "gelu";
  }
  TORCH_CHECK_TYPE(false, kWho, ": the layers' activation is a std::function, which the cached step cannot ",
                   "compute; supported activations: torch::kReLU, torch::kGELU");
}

// decoder_step takes torch's layer configuration only (what LibTorch's layers build): packed
// in-projection, no bias_k/bias_v, no add_zero_attn.
void check_attention(const MultiheadAttentionImpl& attention, size_t layer, const char* which) {
  TORCH_CHECK_TYPE(attention._qkv_same_embed_dim && attention.in_proj_weight.defined() &&
                       !attention.bias_k.defined() && !attention.options.add_zero_attn(),
                   kWho, ": layer ", layer, "'s ", which, " must have torch's layer configuration (packed ",
                   "in-projection, no bias_k/bias_v, no add_zero_attn)");
}

// (The activation is checked where it is read, in stack_config, also at construction.)
void check_layer(const TransformerDecoderLayerImpl& layer, size_t i) {
  check_attention(*layer.self_attn, i, "self_attn");
  check_attention(*layer.multihead_attn, i, "multihead_attn");
}

void check_layer(const TransformerEncoderLayerImpl& layer, size_t i) {
  check_attention(*layer.self_attn, i, "self_attn");
}

// ------------------------------------------------------------------------ parameter list

void push_absent(Params& params, int count) {
  for (int i = 0; i < count; ++i) {
    params.push_back(std::nullopt);
  }
}

void push_attention(Params& params, const MultiheadAttentionImpl& attention) {
  params.push_back(optional_if_defined(attention.in_proj_weight));
  params.push_back(optional_if_defined(attention.in_proj_bias));
  params.push_back(attention.out_proj->weight);
  params.push_back(optional_if_defined(attention.out_proj->bias));
}

// A Linear's or a LayerNorm's weight and bias (a LayerNorm without elementwise_affine has none).
template <typename Module>
void push_weight_bias(Params& params, const Module& module) {
  params.push_back(optional_if_defined(module.weight));
  params.push_back(optional_if_defined(module.bias));
}

void push_layer(Params& params, const TransformerDecoderLayerImpl& layer) {
  push_attention(params, *layer.self_attn);
  push_attention(params, *layer.multihead_attn);
  push_weight_bias(params, *layer.linear1);
  push_weight_bias(params, *layer.linear2);
  push_weight_bias(params, *layer.norm1);
  push_weight_bias(params, *layer.norm2);
  push_weight_bias(params, *layer.norm3);
}

void push_layer(Params& params, const TransformerEncoderLayerImpl& layer) {
  push_attention(params, *layer.self_attn);
  push_absent(params, 4);  // no cross-attention
  push_weight_bias(params, *layer.linear1);
  push_weight_bias(params, *layer.linear2);
  push_weight_bias(params, *layer.norm1);
  push_weight_bias(params, *layer.norm2);
  push_absent(params, 2);  // no norm3
}

// ---------------------------------------------------------------------- configuration

// decoder_step's per-layer configuration, read from the modules once, at construction.
struct StackConfig {
  std::vector<std::string> activations;
  c10::List<bool> norm_first;
  std::vector<double> eps;
  std::optional<double> final_norm_eps;
};

void push_layer_config(StackConfig& config, const TransformerDecoderLayerImpl& layer) {
  config.activations.push_back(activation_name(layer.options.activation()));
  config.norm_first.push_back(false);  // LibTorch's layers are post-norm
  config.eps.insert(config.eps.end(), {layer.norm1->options.eps(), layer.norm2->options.eps(),
                                       layer.norm3->options.eps()});
}

void push_layer_config(StackConfig& config, const TransformerEncoderLayerImpl& layer) {
  config.activations.push_back(activation_name(layer.options.activation()));
  config.norm_first.push_back(false);
  config.eps.insert(config.eps.end(), {layer.norm1->options.eps(), layer.norm2->options.eps(), kAbsentNormEps});
}

StackConfig stack_config(const torch::nn::ModuleList& layers, bool decoder, const torch::nn::AnyModule& norm) {
  StackConfig config;
  for_each_layer(layers, decoder, [&](const auto& layer, size_t) { push_layer_config(config, layer); });
  if (const auto* layer_norm = final_layer_norm(norm)) {
    config.final_norm_eps = layer_norm->options.eps();
  }
  return config;
}

// The first layer's self-attention: the heads, and the dtype and device of the caches.
const MultiheadAttentionImpl& first_attention(const torch::nn::ModuleList& layers, bool decoder) {
  return decoder ? *layer_at<TransformerDecoderLayerImpl>(layers, 0, "torch::nn::TransformerDecoderLayer").self_attn
                 : *layer_at<TransformerEncoderLayerImpl>(layers, 0, "torch::nn::TransformerEncoderLayer").self_attn;
}

// What changes when a weight does: replaced (its TensorImpl), written in place (its version; none
// for an inference tensor), moved or cast (its storage).
struct WeightStamp {
  const void* impl;
  int64_t version;
  const void* data;
  bool operator==(const WeightStamp& other) const {
    return impl == other.impl && version == other.version && data == other.data;
  }
};

WeightStamp stamp(const Tensor& weight) {
  return {weight.unsafeGetTensorImpl(), core::weight_version(weight), weight.const_data_ptr()};
}

}  // namespace

// ---------------------------------------------------------------------------- int8 weights

struct CachedDecoder::Int8Weights {
  std::mutex mutex;  // (steps of one model from several threads re-quantize once)
  Params weights, scales;
  std::vector<size_t> slots;  // the linear weights' indices in the parameter list
  std::vector<WeightStamp> stamps;

  void quantize(const Params& params) {
    std::tie(weights, scales) = decoder_quantize(params);
    slots.clear();
    stamps.clear();
    bool inference = false;
    for (size_t i = 0; i < weights.size(); ++i) {
      if (weights.get(i).has_value()) {
        slots.push_back(i);
        stamps.push_back(stamp(*params.get(i)));
        inference = inference || params.get(i)->is_inference();
      }
    }
    if (inference) {
      TORCH_WARN(kWho, ": the model's weights are inference tensors (made under InferenceMode), which keep no ",
                 "version counter, so a step cannot see a change written into them in place; call refresh() ",
                 "after one");
    }
  }

  bool fresh(const Params& params) const {
    for (size_t j = 0; j < slots.size(); ++j) {
      const auto weight = params.get(slots[j]);
      if (!weight.has_value() || !(stamp(*weight) == stamps[j])) {
        return false;
      }
    }
    return true;
  }
};

// -------------------------------------------------------------------------- CachedDecoder

CachedDecoder::CachedDecoder(torch::nn::TransformerDecoder decoder, std::optional<at::ScalarType> weight_dtype)
    : decoder_(std::move(decoder)), weight_dtype_(weight_dtype) {
  TORCH_CHECK_VALUE(decoder_, kWho, ": the TransformerDecoder is empty (nullptr)");
  check_stack();
}

CachedDecoder::CachedDecoder(torch::nn::TransformerEncoder encoder, std::optional<at::ScalarType> weight_dtype)
    : encoder_(std::move(encoder)), weight_dtype_(weight_dtype) {
  TORCH_CHECK_VALUE(encoder_, kWho, ": the TransformerEncoder is empty (nullptr)");
  check_stack();
}

void CachedDecoder::refresh() const {
  if (int8_) {
    const std::lock_guard<std::mutex> lock(int8_->mutex);
    int8_->quantize(parameter_list());
  }
}

std::pair<Params, Params> CachedDecoder::step_parameters() const {
  Params params = parameter_list();
  if (!int8_) {
    return {params, Params()};
  }
  const std::lock_guard<std::mutex> lock(int8_->mutex);
  if (!int8_->fresh(params)) {
    int8_->quantize(params);
  }
  for (const size_t i : int8_->slots) {
    params.set(i, int8_->weights.get(i));
  }
  return {params, int8_->scales};
}

const torch::nn::ModuleList& CachedDecoder::layers() const {
  return is_decoder() ? decoder_->layers : encoder_->layers;
}

const torch::nn::AnyModule& CachedDecoder::final_norm() const {
  return is_decoder() ? decoder_->norm : encoder_->norm;
}

int64_t CachedDecoder::num_layers() const {
  return static_cast<int64_t>(layers()->size());
}

// Every check that does not depend on the input, once, so a model the step cannot run fails here.
void CachedDecoder::check_stack() {
  TORCH_CHECK_VALUE(!layers()->is_empty(), kWho, ": the model has no layers");
  for_each_layer(layers(), is_decoder(), [](const auto& layer, size_t i) { check_layer(layer, i); });
  final_layer_norm(final_norm());
  const auto& attention = first_attention(layers(), is_decoder());
  num_heads_ = attention.options.num_heads();
  head_dim_ = attention.head_dim;
  auto config = stack_config(layers(), is_decoder(), final_norm());
  activations_ = std::move(config.activations);
  norm_first_ = std::move(config.norm_first);
  eps_ = std::move(config.eps);
  final_norm_eps_ = config.final_norm_eps;
  TORCH_CHECK_VALUE(!weight_dtype_.has_value() || *weight_dtype_ == at::kChar, kWho, ": weight_dtype must be ",
                    "at::kChar (int8) or none (the model's own weights), not ", *weight_dtype_);
  if (weight_dtype_.has_value()) {
    int8_ = std::make_shared<Int8Weights>();
    int8_->quantize(parameter_list());
  }
}

c10::List<std::optional<at::Tensor>> CachedDecoder::parameter_list() const {
  Params params;
  params.reserve(layers()->size() * 18 + 2);
  for_each_layer(layers(), is_decoder(), [&](const auto& layer, size_t) { push_layer(params, layer); });
  if (const auto* layer_norm = final_layer_norm(final_norm())) {
    push_weight_bias(params, *layer_norm);
  } else {
    push_absent(params, 2);
  }
  return params;
}

std::tuple<Tensor, Tensor, Tensor> CachedDecoder::project_memory(const Tensor& memory,
                                                                 const Tensor& memory_key_padding_mask) const {
  TORCH_CHECK_VALUE(is_decoder(), kWho, ": an encoder has no memory; new_state and reset take memory only for a ",
                    "decoder (torch::nn::TransformerDecoder)");
  TORCH_CHECK_VALUE(memory.defined(), kWho, ": memory_key_padding_mask goes with a memory");
  const auto [params, scales] = step_parameters();
  return decoder_memory(memory, params, num_heads_, /*batch_first=*/false, optional_if_defined(memory_key_padding_mask),
                        scales);
}

DecoderState CachedDecoder::new_state(int64_t batch_size, int64_t max_length, const Tensor& memory,
                                      const Tensor& memory_key_padding_mask) const {
  TORCH_CHECK_VALUE(batch_size > 0 && max_length > 0, kWho, ".new_state: batch_size and max_length must be ",
                    "positive, but got ", batch_size, " and ", max_length);
  TORCH_CHECK_VALUE(!is_decoder() || memory.defined(), kWho,
                    ".new_state: a decoder needs memory (the encoder's output)");
  DecoderState state(*this);
  if (memory.defined() || memory_key_padding_mask.defined()) {
    std::tie(state.memory_keys_, state.memory_values_, state.memory_padding_) =
        project_memory(memory, memory_key_padding_mask);
    TORCH_CHECK_VALUE(state.memory_keys_.size(1) == batch_size, kWho, ".new_state: memory ", memory.sizes(),
                      " holds ", state.memory_keys_.size(1), " sequences, but batch_size is ", batch_size);
  }
  const auto options = first_attention(layers(), is_decoder()).out_proj->weight.options();
  state.keys_ = at::zeros({num_layers(), batch_size, num_heads_, max_length, head_dim_}, options);
  state.values_ = at::zeros_like(state.keys_);
  state.lengths_ = at::zeros({batch_size}, options.dtype(at::kLong));
  return state;
}

Tensor CachedDecoder::forward(const Tensor& tgt, DecoderState& state, const Tensor& new_lengths) const {
  const bool training = is_decoder() ? decoder_->is_training() : encoder_->is_training();
  const auto [params, scales] = step_parameters();
  return decoder_step(tgt, params, state.cache(), num_heads_, activations_, norm_first_, eps_, final_norm_eps_,
                      /*batch_first=*/false, training, optional_if_defined(new_lengths), scales);
}

// --------------------------------------------------------------------------- DecoderState

DecoderCache DecoderState::cache() const {
  return {keys_, values_, lengths_, optional_if_defined(memory_keys_), optional_if_defined(memory_values_),
          optional_if_defined(memory_padding_)};
}

void DecoderState::reorder(const Tensor& indices) {
  decoder_reorder(cache(), indices);}

void DecoderState::reset(const Tensor& slots, const Tensor& memory, const Tensor& memory_key_padding_mask) {
  Tensor new_keys, new_values, new_padding;
  if (memory.defined() || memory_key_padding_mask.defined()) {
    std::tie(new_keys, new_values, new_padding) = decoder_.project_memory(memory, memory_key_padding_mask);
  }
  decoder_reset(cache(), optional_if_defined(slots), optional_if_defined(new_keys), optional_if_defined(new_values),
                optional_if_defined(new_padding));}

}  // namespace torchmha
