#pragma once

// Cached generation through a stack of torch's Transformer layers (nn.TransformerDecoderLayer or
// nn.TransformerEncoderLayer run causally): one step of the whole stack over the new positions of
// each sequence, on the decoding steps of cached_attention.h (self-attention through the cache,
// cross-attention to a memory projected once), with the layers' norms and feed-forward between.

#include "arguments.h"

#include <torchmha/export.h>

#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace torchmha::core {

/// A layer's feed-forward activation: one the step computes itself (torch's strings and the
/// callables torch's layers are commonly built with; the Python shell maps a callable to its
/// name), or any other callable as an op `Tensor(Tensor)` called through the dispatcher, named
/// "op:<namespace>::<name>" (the Python shell registers one per callable).
struct Activation {
  enum Kind { kRelu, kGelu, kGeluTanh, kSilu, kOp } kind = kRelu;
  std::string op;  // kOp: the op's qualified name
};
Activation parse_activation(c10::string_view name);
/// x activated, in place where nothing records or transforms it (x is then a fresh buffer).
Tensor activate(Tensor x, const Activation& activation);

/// The version of a weight that a staleness check of its int8 copy compares: its version counter,
/// or -1 for an inference tensor (made under inference mode), which keeps none (a step then sees
/// the weight replaced or moved, not written in place: the shells warn when they quantize one).
TORCHMHA_API int64_t weight_version(const Tensor& weight);

struct LayerNormWeights {
  OptionalTensor weight, bias;
  double eps = 1e-5;
};

/// layer_norm of x over its last dimension.
Tensor norm(const Tensor& x, const LayerNormWeights& n);

/// One layer's parameters and configuration, as nn.TransformerDecoderLayer holds them (an
/// encoder layer has no cross-attention and no norm3).
struct StackLayer {
  AttentionWeights self_attn;
  std::optional<AttentionWeights> cross_attn;
  Tensor linear1_weight, linear2_weight;
  OptionalTensor linear1_bias, linear2_bias;
  OptionalTensor linear1_weight_scale, linear2_weight_scale;  // with int8 weights
  LayerNormWeights norm1, norm2, norm3;
  Activation activation;
  bool norm_first = false;
};

/// One layer's blocks in the order torch's layers run them, the one home of that order for both
/// steps (stack_step's composition and kernel_step): pre-norm, x + block(norm(x)) for each block;
/// post-norm, norm(x + block(x)). `blocks` gives each block's result, self_attention(y),
/// cross_attention(y) and feed_forward(y), and the residuals, add(x, y) (x + y) and
/// add_norm(x, y, n) (norm(x + y)).
template <typename Blocks>
Tensor run_layer(Tensor x, const StackLayer& layer, Blocks& blocks) {
  const bool cross = layer.cross_attn.has_value();
  const LayerNormWeights& ff_norm = cross ? layer.norm3 : layer.norm2;
  if (layer.norm_first) {
    x = blocks.add(x, blocks.self_attention(norm(x, layer.norm1)));
    if (cross) {
      x = blocks.add(x, blocks.cross_attention(norm(x, layer.norm2)));
    }
    return blocks.add(x, blocks.feed_forward(norm(x, ff_norm)));
  }
  x = blocks.add_norm(x, blocks.self_attention(x), layer.norm1);
  if (cross) {
    x = blocks.add_norm(x, blocks.cross_attention(x), layer.norm2);
  }
  return blocks.add_norm(x, blocks.feed_forward(x), ff_norm);
}

/// The layers' parameters as the ops take them: kLayerSlots entries per layer, in this order
/// (absent ones None), then the final norm's weight and bias.
enum LayerSlot : int64_t {
  kSelfInWeight, kSelfInBias, kSelfOutWeight, kSelfOutBias,
  kCrossInWeight, kCrossInBias, kCrossOutWeight, kCrossOutBias,
  kLinear1Weight, kLinear1Bias, kLinear2Weight, kLinear2Bias,
  kNorm1Weight, kNorm1Bias, kNorm2Weight, kNorm2Bias, kNorm3Weight, kNorm3Bias,
  kLayerSlots
};

/// The layers from the ops' flat parameter list (layers * kLayerSlots + 2 entries), with each
/// layer's activation name, norm_first and norm eps (norm1, norm2, norm3: 3 per layer).
/// `scales` is empty, or as long as `params` with the float32 scale of each int8 weight (the
/// attentions' in- and out-projections, linear1, linear2; small_linear.h's quantize_weight) and
/// nothing elsewhere. Throws naming the mismatch when the lists' lengths or a layer's parameters
/// do not fit.
struct Stack {
  std::vector<StackLayer> layers;
  std::optional<LayerNormWeights> final_norm;
  bool batch_first = false;
  bool decoder() const { return layers.front().cross_attn.has_value(); }
};
Stack stack_from_slots(at::ArrayRef<OptionalTensor> params, at::ArrayRef<OptionalTensor> scales, int64_t num_heads,
                       at::ArrayRef<c10::string_view> activations, const std::vector<bool>& norm_first,
                       at::ArrayRef<double> eps, std::optional<double> final_norm_eps, bool batch_first);

/// int8 copies of the linear weights in a parameter list (stack_from_slots' order): {weights, scales},
/// each as long as `params`, with quantize_weight's int8 weight and float32 scale at each linear
/// weight's index (the attentions' in- and out-projections, linear1, linear2) and nothing elsewhere.
std::tuple<std::vector<OptionalTensor>, std::vector<OptionalTensor>> quantize_stack_weights(
    at::ArrayRef<OptionalTensor> params);

/// What a generation holds between steps. keys, values: (layers, N, H, M, D) self-attention
/// caches; lengths (N,) int64; a decoder's memory keys and values (layers, N, H, S, D) and its
/// padding (N, S), additive in the model's dtype.
using StackState = DecoderCache;  // (attention_arguments.h)

/// One step: tgt (T, N, E) (batch_first: (N, T, E)) holds up to T new positions per sequence;
/// sequence n appends its first new_lengths[n] (all T if absent) and gets the stack's output at
/// them, equal to the stack's causal forward over its own prefix. Rows past new_lengths are
/// zeros. Every check runs before lengths advance, so a failed step leaves the state as it was.
Tensor stack_step(const Tensor& tgt, const Stack& stack, const StackState& state, const OptionalTensor& new_lengths,
                  bool training);

/// stack_step through torchmha's CPU kernels into buffers made once a step (stack_kernel_step.cpp):
/// the composition's results, for one new position per sequence on the CPU (the inputs it takes
/// are listed there); nullopt, with nothing written, for the rest. TORCHMHA_KERNEL_STEP=0 never.
std::optional<Tensor> kernel_step(const Tensor& tgt, const Stack& stack, const StackState& state,
                                  const OptionalTensor& new_lengths);

/// A decoder's memory (S, N, E) (batch_first: (N, S, E)) projected once through every layer's
/// cross-attention: {keys, values}, (layers, N, H, S, D) each.
std::tuple<Tensor, Tensor> project_stack_memory(const Tensor& memory, const Stack& stack);

/// A memory's key_padding_mask (bool, true = ignore, or float, added) as the state's additive
/// (N, S) padding in `dtype`; zeros when absent.
Tensor memory_padding(const OptionalTensor& mask, int64_t batch, int64_t src_len, const Tensor& like);

/// Beam search: sequence i of every part of the state becomes old sequence indices[i] (in place).
void reorder_stack_state(const StackState& state, const Tensor& indices);

/// Empties the sequences `slots` (a 1-D integer index or bool mask; all if absent). With
/// new_keys/new_values (layers, k, H, S', D), S' <= S, for the k sequences, their memory becomes
/// that (positions past S' masked) with new_padding (k, S') (additive; zeros if absent).
void reset_stack_state(const StackState& state, const OptionalTensor& slots, const OptionalTensor& new_keys,
                       const OptionalTensor& new_values, const OptionalTensor& new_padding);

}  // namespace torchmha::core
