#pragma once

// The arguments of torchmha's attention ops, named once: a module's parameters
// (AttentionParameters), one forward call's masks and flags (AttentionOptions), one decoding
// step's (DecodingOptions), a Transformer block's feed-forward network (FeedForwardParameters) and
// a cached generation's tensors (DecoderCache).
// The functional API (functional.h), the modules and the op schemas all take these structs: the
// schemas (register_ops.cpp) are written from each struct's for_each_field, and the ops read their
// arguments back through it. A new argument is a member and its line in for_each_field.
//
// Absent tensors are std::nullopt (an undefined tensor counts as absent too). Shapes: E =
// embed_dim, H = num_heads, D = head_dim, inner = H * D (E for torch's modules).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace torchmha {

/// A multi-head attention's parameters, in torch.nn.MultiheadAttention's form: the packed
/// in_proj_weight (3 inner, E), or, when it is absent, q_proj_weight (inner, E), k_proj_weight
/// (inner, kdim), v_proj_weight (inner, vdim); in_proj_bias (3 inner), or the separate q/k/v
/// biases (inner) of Linear layers (v1-v3); bias_k, bias_v (1, 1, inner); out_proj (E_out, inner).
struct AttentionParameters {
  int64_t num_heads = 1;
  /// The size of a head. Absent: embed_dim / num_heads, as in torch. Given, the in-projection maps
  /// to inner = num_heads * head_dim, which may differ from E (head parallelism: one rank's heads).
  std::optional<int64_t> head_dim;
  std::optional<at::Tensor> in_proj_weight, in_proj_bias;
  std::optional<at::Tensor> q_proj_weight, k_proj_weight, v_proj_weight;
  std::optional<at::Tensor> q_proj_bias, k_proj_bias, v_proj_bias;
  std::optional<at::Tensor> bias_k, bias_v;  // one more key/value position each
  bool add_zero_attn = false;                // one more all-zero key/value position
  std::optional<at::Tensor> out_proj_weight, out_proj_bias;

  /// Each member with its declaration in the op schemas, in the schemas' order.
  template <typename Visit>
  void for_each_field(Visit&& visit) {
    visit("int num_heads", num_heads);
    visit("int? head_dim=None", head_dim);
    visit("Tensor? in_proj_weight=None", in_proj_weight);
    visit("Tensor? in_proj_bias=None", in_proj_bias);
    visit("Tensor? q_proj_weight=None", q_proj_weight);
    visit("Tensor? k_proj_weight=None", k_proj_weight);
    visit("Tensor? v_proj_weight=None", v_proj_weight);
    visit("Tensor? q_proj_bias=None", q_proj_bias);
    visit("Tensor? k_proj_bias=None", k_proj_bias);
    visit("Tensor? v_proj_bias=None", v_proj_bias);
    visit("Tensor? bias_k=None", bias_k);
    visit("Tensor? bias_v=None", bias_v);
    visit("bool add_zero_attn=False", add_zero_attn);
    visit("Tensor? out_proj_weight=None", out_proj_weight);
    visit("Tensor? out_proj_bias=None", out_proj_bias);
  }
};

/// One forward call's masks and flags (torch.nn.MultiheadAttention.forward's, plus the module's
/// dropout and batch_first and the functional API's static_k/static_v).
///  - key_padding_mask (N, S) or (S); attn_mask (L, S) or (N*H, L, S); bool masks: true = not
///    allowed to attend; float masks are added to the scores;
///  - is_causal: a hint that attn_mask is causal; it needs attn_mask, as in torch;
///  - allow_fast_path: take torch's fused inference path where torch would;
///  - static_k, static_v (N*H, S, D): keys and values used instead of the projected ones.
struct AttentionOptions {
  std::optional<at::Tensor> key_padding_mask, attn_mask;
  bool need_weights = true;
  bool average_attn_weights = true;
  bool is_causal = false;
  bool training = true;
  bool batch_first = false;
  double dropout_p = 0.0;
  bool allow_fast_path = false;
  std::optional<at::Tensor> static_k, static_v;

  double effective_dropout() const { return training ? dropout_p : 0.0; }

  template <typename Visit>
  void for_each_field(Visit&& visit) {
    visit("Tensor? key_padding_mask=None", key_padding_mask);
    visit("Tensor? attn_mask=None", attn_mask);
    visit("bool need_weights=True", need_weights);
    visit("bool average_attn_weights=True", average_attn_weights);
    visit("bool is_causal=False", is_causal);
    visit("bool training=True", training);
    visit("bool batch_first=False", batch_first);
    visit("float dropout_p=0.", dropout_p);
    visit("bool allow_fast_path=False", allow_fast_path);
    visit("Tensor? static_k=None", static_k);
    visit("Tensor? static_v=None", static_v);
  }
};

/// A TransformerBlock call's masks and flags: those of its self-attention that the block does not
/// fix (it is batch first, returns no weights and has no static keys or values).
struct BlockOptions {
  std::optional<at::Tensor> key_padding_mask, attn_mask;
  bool is_causal = false;
  bool training = true;
  double dropout_p = 0.0;
  bool allow_fast_path = false;

  template <typename Visit>
  void for_each_field(Visit&& visit) {
    visit("Tensor? key_padding_mask=None", key_padding_mask);
    visit("Tensor? attn_mask=None", attn_mask);
    visit("bool is_causal=False", is_causal);
    visit("bool training=True", training);
    visit("float dropout_p=0.", dropout_p);
    visit("bool allow_fast_path=False", allow_fast_path);
  }
};

/// One decoding step's mask and flags (attention to a cache or to a projected memory):
/// key_padding_mask (N, S) masks positions [0, S).
struct DecodingOptions {
  std::optional<at::Tensor> key_padding_mask;
  double dropout_p = 0.0;
  bool training = false;
  bool batch_first = false;

  double effective_dropout() const { return training ? dropout_p : 0.0; }

  template <typename Visit>
  void for_each_field(Visit&& visit) {
    visit("Tensor? key_padding_mask=None", key_padding_mask);
    visit("float dropout_p=0.", dropout_p);
    visit("bool training=False", training);
    visit("bool batch_first=False", batch_first);
  }
};

/// A Transformer block's feed-forward network Linear - ReLU - Linear and its two LayerNorms
/// (torch.nn.TransformerEncoderLayer's linear1, linear2, norm1, norm2).
struct FeedForwardParameters {
  at::Tensor linear1_weight;
  std::optional<at::Tensor> linear1_bias;
  at::Tensor linear2_weight;
  std::optional<at::Tensor> linear2_bias;
  at::Tensor norm1_weight, norm1_bias, norm2_weight, norm2_bias;
  double layer_norm_eps = 1e-5;
  double dropout_p = 0.0;   // on each sublayer's output and the hidden layer (training only)
  bool norm_first = false;  // LayerNorm before each sublayer instead of after

  template <typename Visit>
  void for_each_field(Visit&& visit) {
    visit("Tensor linear1_weight", linear1_weight);
    visit("Tensor? linear1_bias", linear1_bias);
    visit("Tensor linear2_weight", linear2_weight);
    visit("Tensor? linear2_bias", linear2_bias);
    visit("Tensor norm1_weight", norm1_weight);
    visit("Tensor norm1_bias", norm1_bias);
    visit("Tensor norm2_weight", norm2_weight);
    visit("Tensor norm2_bias", norm2_bias);
    visit("float layer_norm_eps", layer_norm_eps);
    visit("float dropout", dropout_p);
    visit("bool norm_first", norm_first);
  }
};

/// What a cached generation through a stack of Transformer layers holds between steps
/// (CachedDecoder's DecoderState): self-attention caches keys, values (layers, N, H, M, D),
/// lengths (N,) int64, and a decoder's memory_keys, memory_values (layers, N, H, S, D) and
/// memory_padding (N, S), additive. The decoder ops write them in place.
struct DecoderCache {
  at::Tensor keys, values, lengths;
  std::optional<at::Tensor> memory_keys, memory_values, memory_padding;

  template <typename Visit>
  void for_each_field(Visit&& visit) {
    visit("Tensor(a!) keys", keys);
    visit("Tensor(b!) values", values);
    visit("Tensor(c!) lengths", lengths);
    visit("Tensor(d!)? memory_keys", memory_keys);
    visit("Tensor(e!)? memory_values", memory_values);
    visit("Tensor(f!)? memory_padding", memory_padding);
  }
};

}  // namespace torchmha
