// Cached generation through a stack of torch's Transformer layers (cached_decoder.h).

#include "cached_decoder.h"

#include "attend.h"
#include "cached_attention.h"
#include "checks.h"
#include "decode_attention.h"
#include "small_linear.h"

#include "cpu/kernels.h"

#include <torchmha/errors.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>

namespace torchmha::core {
namespace {

constexpr const char* kWho = "CachedDecoder";

OptionalTensor slot(at::ArrayRef<OptionalTensor> params, int64_t layer, LayerSlot s) {
  if (params.empty()) {  // (no scales)
    return std::nullopt;
  }
  const auto& t = params[layer * kLayerSlots + s];
  return is_present(t) ? t : std::nullopt;
}

// The scale of the weight in slot `s` (present with an int8 weight only), checked against it. A
// float weight without a scale, every weight of a float step, needs no check (nor its message).
OptionalTensor scale_slot(at::ArrayRef<OptionalTensor> params, at::ArrayRef<OptionalTensor> scales, int64_t layer,
                          LayerSlot s, const char* which, const char* what) {
  const auto scale = slot(scales, layer, s);
  const auto weight = slot(params, layer, s);
  if (is_present(weight) && (is_present(scale) || weight->scalar_type() == at::kChar)) {
    check_weight_scale(*weight, scale, kWho, ": layer ", layer, "'s ", which, what);
  }
  return scale;
}

bool is_linear_weight(int64_t index) {
  const auto s = index % kLayerSlots;
  return s == kSelfInWeight || s == kSelfOutWeight || s == kCrossInWeight || s == kCrossOutWeight ||
      s == kLinear1Weight || s == kLinear2Weight;
}

// An attention of torch's layers: packed in-projection (kdim == vdim == d_model), no extra keys.
AttentionWeights attention_from_slots(at::ArrayRef<OptionalTensor> params, at::ArrayRef<OptionalTensor> scales,
                                      int64_t layer, LayerSlot in_weight, int64_t num_heads, const char* which) {
  AttentionWeights w;
  w.num_heads = num_heads;
  w.in_proj.packed_weight = slot(params, layer, in_weight);
  w.in_proj.packed_bias = slot(params, layer, LayerSlot(in_weight + 1));
  const auto out_weight = slot(params, layer, LayerSlot(in_weight + 2));
  TORCH_CHECK(is_present(w.in_proj.packed_weight) && is_present(out_weight), kWho, ": layer ", layer, "'s ", which,
              " needs in_proj_weight and out_proj.weight");
  w.out_weight = *out_weight;
  w.out_bias = slot(params, layer, LayerSlot(in_weight + 3));
  w.in_proj.packed_weight_scale = scale_slot(params, scales, layer, in_weight, which, ".in_proj_weight");
  w.out_weight_scale = scale_slot(params, scales, layer, LayerSlot(in_weight + 2), which, ".out_proj.weight");
  return w;
}

LayerNormWeights norm_from_slots(at::ArrayRef<OptionalTensor> params, int64_t layer, LayerSlot weight, double eps) {
  return {slot(params, layer, weight), slot(params, layer, LayerSlot(weight + 1)), eps};
}

}  // namespace

// The feed-forward's hidden activated, in place where nothing records or transforms it (the
// hidden is the first linear's fresh output; a new one cost a step at 8 rows 6 allocations of 64
// KB, which glibc hands back to the kernel between steps: 20 us a call of its page faults).
Tensor activate(Tensor x, const Activation& activation) {
  const bool in_place = !transformed({x}) && !records_grad({x});
  switch (activation.kind) {
    case Activation::kRelu: return in_place ? at::relu_(x) : at::relu(x);
    case Activation::kGelu: return in_place ? at::gelu_(x) : at::gelu(x);
    case Activation::kGeluTanh: return in_place ? at::gelu_(x, "tanh") : at::gelu(x, "tanh");
    case Activation::kSilu: return in_place ? at::silu_(x) : at::silu(x);
    case Activation::kOp: {
      const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(activation.op.c_str(), "");
      return op.typed<Tensor(const Tensor&)>().call(x);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown activation");
}

Tensor norm(const Tensor& x, const LayerNormWeights& n) {
  return at::layer_norm(x, {x.size(-1)}, n.weight, n.bias, n.eps);
}

namespace {

// norm(x + y): torchmha's one-pass kernel where it takes the call (no gradient or trace), else
// ATen's add and layer_norm.
Tensor add_norm(const Tensor& x, const Tensor& y, const LayerNormWeights& n) {
  const Tensor weight = is_present(n.weight) ? *n.weight : Tensor(), bias = is_present(n.bias) ? *n.bias : Tensor();
  if (!transformed({x, y, weight, bias}) && !records_grad({x, y, weight, bias})) {
    if (auto out = cpu::residual_layer_norm(x, y, n.weight, n.bias, n.eps)) {
      return *std::move(out);
    }
  }
  return norm(x + y, n);
}

// Before anything is written: the step's inputs against the state and the model.
void check_step(const Tensor& tgt, const Stack& stack, const StackState& state) {
  TORCHMHA_CHECK_ARG(tgt.dim() == 3, kWho, ": expected tgt of shape ",
                     stack.batch_first ? "(N, T, E)" : "(T, N, E)", " (the model's layout), but got ", tgt.sizes());
  const int64_t batch = tgt.size(batch_dim(stack.batch_first));
  const int64_t embed_dim = stack.layers.front().self_attn.in_proj.packed_weight->size(1);
  TORCH_CHECK_VALUE(batch == state.lengths.size(0), kWho, ": the state holds ", state.lengths.size(0),
                    " sequences, but tgt ", tgt.sizes(), " has batch size ", batch,
                    "; make a state with new_state(batch_size=", batch, ", ...)");
  TORCH_CHECK_VALUE(tgt.size(-1) == embed_dim, kWho, ": tgt ", tgt.sizes(), " has embedding size ", tgt.size(-1),
                    ", but the model's d_model is ", embed_dim);
  TORCH_CHECK(tgt.scalar_type() == state.keys.scalar_type() && tgt.device() == state.keys.device(), kWho,
              ": tgt must have the state's dtype and device (", state.keys.scalar_type(), ", ", state.keys.device(),
              "), but got ", tgt.scalar_type(), ", ", tgt.device());
  TORCH_CHECK_VALUE(state.keys.dim() == 5 && state.keys.size(0) == static_cast<int64_t>(stack.layers.size()), kWho,
                    ": the state's caches ", state.keys.sizes(), " are not for this model's ", stack.layers.size(),
                    " layers");
  TORCH_CHECK_VALUE(stack.decoder() == is_present(state.memory_keys), kWho, ": ",
                    stack.decoder() ? "a decoder's state needs the memory's keys and values (new_state(memory=...))"
                                    : "an encoder's state has no memory");
}

// The composition's blocks (run_layer): the decoding pipelines of cached_attention.h, each
// kernel reached through its op.
struct ComposedBlocks {
  const StackLayer& layer;
  int64_t index;
  const StackState& state;
  const Tensor& start;
  const OptionalTensor& new_lengths;
  DecodingCall self_call, cross_call;

  ComposedBlocks(const StackLayer& layer, int64_t index, const StackState& state, const Tensor& start,
                 const OptionalTensor& new_lengths, bool batch_first)
      : layer(layer), index(index), state(state), start(start), new_lengths(new_lengths) {
    self_call.batch_first = batch_first;
    cross_call = self_call;
    cross_call.key_padding_mask = state.memory_padding;
  }
  Tensor self_attention(const Tensor& y) const {
    // attention_with_cache advances the lengths it gets; the stack's lengths advance once, at the end.
    return attention_with_cache(y, state.keys[index], state.values[index], start.clone(), new_lengths,
                                layer.self_attn, self_call);
  }
  Tensor cross_attention(const Tensor& y) const {
    return attention_with_static_key_value(y, (*state.memory_keys)[index], (*state.memory_values)[index],
                                           *layer.cross_attn, cross_call);
  }
  Tensor feed_forward(const Tensor& y) const {
    const Tensor hidden = linear_layer(y, layer.linear1_weight, layer.linear1_bias, layer.linear1_weight_scale);
    return linear_layer(activate(hidden, layer.activation), layer.linear2_weight, layer.linear2_bias,
                        layer.linear2_weight_scale);
  }
  Tensor add(const Tensor& x, const Tensor& y) const { return x + y; }
  Tensor add_norm(const Tensor& x, const Tensor& y, const LayerNormWeights& n) const {
    return core::add_norm(x, y, n);
  }
};

// The sequences `slots` name, as a 1-D int64 index on `like`'s device (all if absent).
Tensor slot_index(const OptionalTensor& slots, const Tensor& lengths) {
  if (!is_present(slots)) {
    return at::arange(lengths.size(0), lengths.options());
  }
  const Tensor s = slots->to(lengths.device());
  return s.scalar_type() == at::kBool ? s.nonzero().view(-1) : s.to(at::kLong).view(-1);
}

}  // namespace

Activation parse_activation(c10::string_view name) {
  if (name == "relu") return {Activation::kRelu, {}};
  if (name == "gelu") return {Activation::kGelu, {}};
  if (name == "gelu_tanh") return {Activation::kGeluTanh, {}};
  if (name == "silu") return {Activation::kSilu, {}};
  TORCH_CHECK_VALUE(name.substr(0, 3) == "op:", kWho, ": activation should be relu, gelu, gelu_tanh, silu or ",
                    "op:<an op Tensor(Tensor)>, not ", name);
  return {Activation::kOp, std::string(name.substr(3))};
}

Stack stack_from_slots(at::ArrayRef<OptionalTensor> params, at::ArrayRef<OptionalTensor> scales, int64_t num_heads,
                       at::ArrayRef<c10::string_view> activations, const std::vector<bool>& norm_first,
                       at::ArrayRef<double> eps, std::optional<double> final_norm_eps, bool batch_first) {
  const int64_t n = static_cast<int64_t>(activations.size());
  TORCH_CHECK_VALUE(n > 0 && static_cast<int64_t>(params.size()) == n * kLayerSlots + 2 &&
                        static_cast<int64_t>(norm_first.size()) == n && static_cast<int64_t>(eps.size()) == 3 * n,
                    kWho, ": expected ", kLayerSlots, " parameters per layer and 2 for the final norm, a norm_first ",
                    "and 3 eps per layer, for ", n, " layers; got ", params.size(), " parameters, ",
                    norm_first.size(), " norm_first, ", eps.size(), " eps");
  TORCH_CHECK_VALUE(scales.empty() || scales.size() == params.size(), kWho, ": expected a weight scale per ",
                    "parameter (", params.size(), "), or none, but got ", scales.size());
  Stack stack;
  stack.batch_first = batch_first;
  for (int64_t l = 0; l < n; ++l) {
    StackLayer layer;
    layer.self_attn = attention_from_slots(params, scales, l, kSelfInWeight, num_heads, "self_attn");
    if (is_present(slot(params, l, kCrossInWeight))) {
      layer.cross_attn = attention_from_slots(params, scales, l, kCrossInWeight, num_heads, "multihead_attn");
    }
    const auto w1 = slot(params, l, kLinear1Weight), w2 = slot(params, l, kLinear2Weight);
    TORCH_CHECK(is_present(w1) && is_present(w2), kWho, ": layer ", l, " needs linear1.weight and linear2.weight");
    layer.linear1_weight = *w1;
    layer.linear2_weight = *w2;
    layer.linear1_bias = slot(params, l, kLinear1Bias);
    layer.linear2_bias = slot(params, l, kLinear2Bias);
    layer.linear1_weight_scale = scale_slot(params, scales, l, kLinear1Weight, "linear1", ".weight");
    layer.linear2_weight_scale = scale_slot(params, scales, l, kLinear2Weight, "linear2", ".weight");
    for (int64_t s = 0; s < kLayerSlots && !scales.empty(); ++s) {
      TORCH_CHECK_VALUE(is_linear_weight(s) || !is_present(slot(scales, l, LayerSlot(s))), kWho, ": layer ", l,
                        "'s parameter ", s, " is not a linear weight, and takes no scale");
    }
    layer.norm1 = norm_from_slots(params, l, kNorm1Weight, eps[3 * l]);
    layer.norm2 = norm_from_slots(params, l, kNorm2Weight, eps[3 * l + 1]);
    layer.norm3 = norm_from_slots(params, l, kNorm3Weight, eps[3 * l + 2]);
    layer.activation = parse_activation(activations[l]);
    layer.norm_first = norm_first[l];
    TORCH_CHECK_VALUE(stack.layers.empty() || layer.cross_attn.has_value() == stack.layers[0].cross_attn.has_value(),
                      kWho, ": the layers mix decoder and encoder layers");
    stack.layers.push_back(std::move(layer));
  }
  TORCH_CHECK_VALUE(scales.empty() || (!is_present(scales[n * kLayerSlots]) && !is_present(scales[n * kLayerSlots + 1])),
                    kWho, ": the final norm takes no scale");
  if (final_norm_eps.has_value()) {
    const auto tail = params.slice(n * kLayerSlots);
    stack.final_norm = LayerNormWeights{is_present(tail[0]) ? tail[0] : std::nullopt,
                                        is_present(tail[1]) ? tail[1] : std::nullopt, *final_norm_eps};
  }
  return stack;
}

Tensor stack_step(const Tensor& tgt, const Stack& stack, const StackState& state, const OptionalTensor& new_lengths,
                  bool training) {
  TORCH_CHECK_VALUE(!training, kWho, ": the model is in training mode, where dropout makes every step differ from ",
                    "the full forward; call model.eval() first");
  check_step(tgt, stack, state);
  if (auto out = kernel_step(tgt, stack, state, new_lengths)) {
    return *std::move(out);
  }
  const Tensor start = state.lengths.clone();  // every layer writes at the same positions
  Tensor x = tgt;
  for (size_t l = 0; l < stack.layers.size(); ++l) {
    ComposedBlocks blocks(stack.layers[l], static_cast<int64_t>(l), state, start, new_lengths, stack.batch_first);
    x = run_layer(x, stack.layers[l], blocks);
  }
  if (stack.final_norm.has_value()) {
    x = norm(x, *stack.final_norm);
  }
  x = zero_rows_past(x, new_lengths, stack.batch_first);
  if (is_present(new_lengths)) {
    state.lengths.add_(*new_lengths);
  } else {
    state.lengths.add_(tgt.size(sequence_dim(stack.batch_first)));
  }
  return x;
}

int64_t weight_version(const Tensor& weight) {
  return weight.is_inference() ? -1 : static_cast<int64_t>(weight._version());
}

std::tuple<std::vector<OptionalTensor>, std::vector<OptionalTensor>> quantize_stack_weights(
    at::ArrayRef<OptionalTensor> params) {
  TORCH_CHECK_VALUE(params.size() % kLayerSlots == 2, kWho, ": expected ", kLayerSlots, " parameters per layer and 2 ",
                    "for the final norm, but got ", params.size());
  std::vector<OptionalTensor> weights(params.size()), scales(params.size());
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i + 2 < params.size(); ++i) {
    if (is_linear_weight(static_cast<int64_t>(i)) && is_present(params[i])) {
      std::tie(weights[i], scales[i]) = quantize_weight(*params[i]);
    }
  }
  return {weights, scales};
}

std::tuple<Tensor, Tensor> project_stack_memory(const Tensor& memory, const Stack& stack) {
  TORCH_CHECK_VALUE(stack.decoder(), kWho, ": an encoder has no memory to attend to; new_state takes memory only "
                    "for a decoder");
  // Each layer's heads as views of its projection, stacked in one pass: made contiguous first (as
  // project_key_value returns them), that was two (new_state at 8 sequences of 64 memory positions,
  // E = 512, AMD EPYC Zen 3, profiled over 5 calls: copies and cat 45.5 ms, the cat of views 23.6).
  std::vector<Tensor> keys, values;
  for (const auto& layer : stack.layers) {
    auto [k, v] = key_value_heads(memory, memory, *layer.cross_attn, stack.batch_first);
    keys.push_back(std::move(k));
    values.push_back(std::move(v));
  }
  return {at::stack(keys), at::stack(values)};
}

Tensor memory_padding(const OptionalTensor& mask, int64_t batch, int64_t src_len, const Tensor& like) {
  if (!is_present(mask)) {
    return at::zeros({batch, src_len}, like.options());
  }
  check_mask_kind(mask, "memory_key_padding_mask");
  check_padding_mask_shape(*mask, batch, src_len, /*batched=*/true);
  auto padding = padding_bias(mask, batch, src_len, like.scalar_type());
  check_mask_dtype(padding, like.scalar_type());
  return padding->view({batch, src_len}).to(like.device()).contiguous();
}

void reorder_stack_state(const StackState& state, const Tensor& indices) {
  const Tensor index = checked_reorder_index(indices, state.lengths, "CachedDecoder state.reorder");
  const auto filled = filled_length(state.lengths);
  reorder_rows(state.keys, 1, 3, index, filled);
  reorder_rows(state.values, 1, 3, index, filled);
  if (is_present(state.memory_keys)) {
    reorder_rows(*state.memory_keys, 1, 3, index, std::nullopt);
    reorder_rows(*state.memory_values, 1, 3, index, std::nullopt);
    reorder_rows(*state.memory_padding, 0, 1, index, std::nullopt);
  }
  state.lengths.copy_(state.lengths.index_select(0, index));
}

void reset_stack_state(const StackState& state, const OptionalTensor& slots, const OptionalTensor& new_keys,
                       const OptionalTensor& new_values, const OptionalTensor& new_padding) {
  reset_cache(state.lengths, slots);  // checks slots
  if (!is_present(new_keys)) {
    return;
  }
  TORCH_CHECK_VALUE(is_present(state.memory_keys), kWho, ": an encoder's state has no memory to reset");
  const Tensor index = slot_index(slots, state.lengths);
  const Tensor& keys = *state.memory_keys;
  const int64_t S = keys.size(3), fresh = new_keys->dim() == 5 ? new_keys->size(3) : -1;
  // (layers, k, H, S', D) each, from decoder_memory for the k slots named
  const auto fits = [&](const OptionalTensor& t) {
    return is_present(t) && t->dim() == 5 && t->size(0) == keys.size(0) && t->size(1) == index.size(0) &&
        t->size(2) == keys.size(2) && t->size(3) == fresh && t->size(4) == keys.size(4) &&
        t->scalar_type() == keys.scalar_type();
  };
  TORCH_CHECK_VALUE(fits(new_keys) && fits(new_values), kWho, ": reset expected the new memory's keys and values ",
                    "of shape (", keys.size(0), ", ", index.size(0), " slots named, ", keys.size(2), ", S', ",
                    keys.size(4), ") in ", keys.scalar_type(), ", but got ", new_keys->sizes(), " and ",
                    is_present(new_values) ? new_values->sizes() : c10::IntArrayRef{});
  TORCH_CHECK_VALUE(fresh <= S, kWho, ": reset got a memory of ", fresh, " positions, but the state holds ", S,
                    " (new_state's memory); make a new state for a longer memory");
  TORCH_CHECK_VALUE(!is_present(new_padding) || new_padding->sizes() == at::IntArrayRef({index.size(0), fresh}),
                    kWho, ": reset expected the new memory's padding of shape (", index.size(0), ", ", fresh,
                    "), but got ", new_padding->sizes());
  for (const auto& [t, value] : {std::pair{keys, *new_keys}, std::pair{*state.memory_values, *new_values}}) {
    t.narrow(3, 0, fresh).index_copy_(1, index, value);
    t.narrow(3, fresh, S - fresh).index_fill_(1, index, 0);
  }
  Tensor rows = at::full({index.size(0), S}, -std::numeric_limits<double>::infinity(), keys.options());
  rows.narrow(1, 0, fresh).copy_(is_present(new_padding) ? *new_padding : at::zeros({index.size(0), fresh}, keys.options()));
  state.memory_padding->index_copy_(0, index, rows);
}

}  // namespace torchmha::core
