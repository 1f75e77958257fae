#pragma once

// Cached generation with LibTorch's own Transformer stacks: torchmha::CachedDecoder runs a
// torch::nn::TransformerDecoder, or a torch::nn::TransformerEncoder run causally (a decoder-only
// model), one step at a time over a key/value cache, one functional call a step (decoder_step in
// functional.h). The C++ counterpart of Python's torchmha.CachedDecoder. Shapes: L layers, N batch,
// H heads, D head_dim, M capacity, S memory length, T new positions, E d_model. LibTorch's layers
// are sequence-first: tgt (T, N, E), memory (S, N, E).

#include <torchmha/attention_arguments.h>
#include <torchmha/export.h>

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/transformercoder.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace torchmha {

class DecoderState;

/// Incremental generation through a LibTorch Transformer stack with a key/value cache. Each
/// forward(tgt, state) appends tgt's positions to each sequence and returns the stack's output
/// there, equal to the module's forward over each sequence's own prefix with a causal tgt_mask
/// (src_mask for an encoder). The layers may use kReLU or kGELU; a std::function activation is
/// refused (c10::TypeError). The model must be in eval mode (dropout would make steps differ).
/// The modules are held, not copied: every step reads their current parameters. With
/// weight_dtype = at::kChar, the layers' linear weights are read as int8 copies instead (one float32
/// scale per output channel; activations, norms and caches keep the model's dtype): made at
/// construction, and again when a step sees that a weight changed (written in place, replaced,
/// moved); refresh() makes them at once (needed after a write through .data(), which no version
/// counter sees, and after a write in place into inference tensors: a model made under
/// c10::InferenceMode keeps no version counter, and the constructor warns).
/// ```
/// torch::nn::TransformerDecoder model(torch::nn::TransformerDecoderOptions(layer, 6));
/// model->eval();
/// torchmha::CachedDecoder dec(model);
/// auto state = dec.new_state(/*batch_size=*/4, /*max_length=*/256, memory);  // memory (S, 4, E)
/// auto y = dec(prompt, state);   // prefill: prompt (T, 4, E) -> the model's output there
/// y = dec(x_t, state);           // then one position at a time, (1, 4, E)
/// state.reorder(beams);          // beam search
/// state.reset(finished, new_memory);  // new requests in those slots
/// ```
class TORCHMHA_API CachedDecoder {
 public:
  /// Throws c10::ValueError for a stack without layers, c10::TypeError for a layer, attention,
  /// activation or final norm (not a LayerNorm) that the step cannot compute.
  /// A weight_dtype other than at::kChar is a c10::ValueError.
  explicit CachedDecoder(torch::nn::TransformerDecoder decoder,
                         std::optional<at::ScalarType> weight_dtype = std::nullopt);
  explicit CachedDecoder(torch::nn::TransformerEncoder encoder,
                         std::optional<at::ScalarType> weight_dtype = std::nullopt);

  /// With int8 weights: quantizes the layers' linear weights again from the parameters now.
  void refresh() const;
  std::optional<at::ScalarType> weight_dtype() const { return weight_dtype_; }

  /// An empty state for batch_size sequences of up to max_length positions, in the model's dtype
  /// and device. A decoder needs its memory (S, N, E), projected here once per layer, and takes
  /// memory_key_padding_mask (N, S): bool (true = ignore) or float (added). An encoder takes
  /// neither (c10::ValueError).
  DecoderState new_state(int64_t batch_size, int64_t max_length, const at::Tensor& memory = {},
                         const at::Tensor& memory_key_padding_mask = {}) const;

  /// Appends tgt (T, N, E) to the sequences of `state` and returns the model's output at those
  /// positions; sequence n takes its first new_lengths[n] ((N,) int64; all T if undefined), and
  /// its rows past that are zeros.
  at::Tensor forward(const at::Tensor& tgt, DecoderState& state, const at::Tensor& new_lengths = {}) const;
  at::Tensor operator()(const at::Tensor& tgt, DecoderState& state, const at::Tensor& new_lengths = {}) const {
    return forward(tgt, state, new_lengths);
  }

  /// The layers' parameters in decoder_step's order (functional.h: 18 a layer, then the final
  /// norm's weight and bias), read from the modules now.
  c10::List<std::optional<at::Tensor>> parameter_list() const;

  bool is_decoder() const { return static_cast<bool>(decoder_); }
  int64_t num_layers() const;
  int64_t num_heads() const { return num_heads_; }
  int64_t head_dim() const { return head_dim_; }

 private:
  friend class DecoderState;
  const torch::nn::ModuleList& layers() const;
  const torch::nn::AnyModule& final_norm() const;
  void check_stack();
  /// decoder_step's params and weight_scales: the parameters now, with the int8 copies (made
  /// again if a weight changed) in the weights' places.
  std::pair<c10::List<std::optional<at::Tensor>>, c10::List<std::optional<at::Tensor>>> step_parameters() const;
  /// decoder_memory through the current parameters: {memory_keys, memory_values, memory_padding}.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> project_memory(const at::Tensor& memory,
                                                                const at::Tensor& memory_key_padding_mask) const;

  // Exactly one of the two is set.
  torch::nn::TransformerDecoder decoder_{nullptr};
  torch::nn::TransformerEncoder encoder_{nullptr};
  int64_t num_heads_ = 0, head_dim_ = 0;
  // The layers' structure for decoder_step, read once at construction (the parameters are read
  // on every step): per layer the activation's name, norm_first and 3 norm eps; the final norm's.
  std::vector<std::string> activations_;
  c10::List<bool> norm_first_;
  std::vector<double> eps_;
  std::optional<double> final_norm_eps_;
  std::optional<at::ScalarType> weight_dtype_;
  // The int8 copies and the stamps of the weights they came from (cached_decoder.cpp); shared by
  // the states' copies of this object, so one quantization serves them all.
  struct Int8Weights;
  std::shared_ptr<Int8Weights> int8_;
};

/// What a generation holds between steps, from CachedDecoder::new_state: keys() and values()
/// (L, N, H, M, D), the self-attention caches; lengths() (N,) int64, the positions filled per
/// sequence; a decoder's memory_keys() and memory_values() (L, N, H, S, D), projected once, and
/// memory_padding() (N, S), additive (undefined for an encoder). Every step writes it in place.
class TORCHMHA_API DecoderState {
 public:
  /// Beam search: sequence i becomes old sequence indices[i]: its caches, length, memory and
  /// memory mask (in place).
  void reorder(const at::Tensor& indices);
  /// Empties the sequences `slots` (a 1-D integer index or a bool mask; all if undefined), so new
  /// ones start there while the others go on. A decoder's new sequences may bring their own
  /// `memory` (S', k, E) for the k slots named, S' <= S (the rest masked), and its
  /// memory_key_padding_mask (k, S'); without one they keep the memory they had.
  void reset(const at::Tensor& slots = {}, const at::Tensor& memory = {},
             const at::Tensor& memory_key_padding_mask = {});

  const at::Tensor& keys() const { return keys_; }
  const at::Tensor& values() const { return values_; }
  /// Positions filled per sequence, (N,) int64 (each step advances it in place).
  const at::Tensor& lengths() const { return lengths_; }
  const at::Tensor& memory_keys() const { return memory_keys_; }
  const at::Tensor& memory_values() const { return memory_values_; }
  const at::Tensor& memory_padding() const { return memory_padding_; }
  int64_t batch_size() const { return keys_.size(1); }
  int64_t max_length() const { return keys_.size(3); }

 private:
  DecoderCache cache() const;  // the decoder ops' view of this state
  friend class CachedDecoder;
  explicit DecoderState(CachedDecoder decoder) : decoder_(std::move(decoder)) {}

  // reset() projects a new memory through it (it holds the modules, so their current parameters).
  CachedDecoder decoder_;
  at::Tensor keys_, values_, lengths_;
  at::Tensor memory_keys_, memory_values_, memory_padding_;
};

}  // namespace torchmha
