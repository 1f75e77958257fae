// The one place torchmha's ops are registered with the dispatcher (torch.ops.torchmha.*).
// This translation unit lives in libtorchmha, which the Python extension and C++ programs both
// load, so TORCH_LIBRARY runs once per process. Each op is a function of the functional API
// (functional.h). The kernels are CompositeImplicitAutograd: written in differentiable ATen ops,
// they get autograd, fake/meta tensors and torch.compile for free.
//
// The module parameters come in torch.nn.MultiheadAttention's form in every attention op:
// in_proj_weight or q/k/v_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn, out_proj.

#include <torchmha/functional.h>

#include "core/blocked_attention.h"
#include "core/decode_attention.h"
#include "core/explicit_attention.h"
#include "core/small_linear.h"

#include <torch/library.h>

TORCH_LIBRARY(torchmha, m) {
  m.def(
      "in_projection_packed(Tensor q, Tensor k, Tensor v, Tensor w, Tensor? b=None) -> Tensor[]",
      TORCH_FN(torchmha::in_projection_packed));
  m.def(
      "in_projection(Tensor q, Tensor k, Tensor v, Tensor w_q, Tensor w_k, Tensor w_v, "
      "Tensor? b_q=None, Tensor? b_k=None, Tensor? b_v=None) -> Tensor[]",
      TORCH_FN(torchmha::in_projection));
  m.def(
      "multi_head_attention_forward(Tensor query, Tensor key, Tensor value, int embed_dim, "
      "int num_heads, Tensor? in_proj_weight, Tensor? in_proj_bias, Tensor? bias_k, Tensor? bias_v, "
      "bool add_zero_attn, float dropout_p, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "bool training=True, Tensor? key_padding_mask=None, bool need_weights=True, "
      "Tensor? attn_mask=None, Tensor? q_proj_weight=None, Tensor? k_proj_weight=None, "
      "Tensor? v_proj_weight=None, bool average_attn_weights=True, bool is_causal=False, "
      "bool batch_first=False, bool allow_fast_path=False, Tensor? q_proj_bias=None, "
      "Tensor? k_proj_bias=None, Tensor? v_proj_bias=None, Tensor? static_k=None, Tensor? static_v=None) "
      "-> (Tensor, Tensor)",
      TORCH_FN(torchmha::multi_head_attention_forward));
  // Decoding. attention_with_cache writes the step's keys and values into the caches in place,
  // which the schema declares (a!)/(b!).
  m.def(
      "attention_with_cache(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) lengths, "
      "int num_heads, Tensor? in_proj_weight, Tensor? in_proj_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor? key_padding_mask=None, float dropout_p=0., bool training=False, bool batch_first=False, "
      "Tensor? q_proj_weight=None, Tensor? k_proj_weight=None, Tensor? v_proj_weight=None, "
      "Tensor? bias_k=None, Tensor? bias_v=None, bool add_zero_attn=False, Tensor? new_lengths=None) -> Tensor",
      TORCH_FN(torchmha::attention_with_cache));
  m.def(
      "reorder_cache(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) lengths, Tensor indices) -> ()",
      TORCH_FN(torchmha::reorder_cache));
  m.def("reset_cache(Tensor(a!) lengths, Tensor? slots=None) -> ()", TORCH_FN(torchmha::reset_cache));
  // Cached generation through a stack of torch's Transformer layers (functional.h: the parameter
  // list's order). The step writes the caches and advances lengths in place.
  m.def(
      "decoder_step(Tensor tgt, Tensor?[] params, Tensor(a!) keys, Tensor(b!) values, Tensor(c!) lengths, "
      "Tensor? memory_keys, Tensor? memory_values, Tensor? memory_padding, int num_heads, str[] activations, "
      "bool[] norm_first, float[] eps, float? final_norm_eps, bool batch_first, bool training, "
      "Tensor? new_lengths=None) -> Tensor",
      TORCH_FN(torchmha::decoder_step));
  m.def(
      "decoder_memory(Tensor memory, Tensor?[] params, int num_heads, bool batch_first, "
      "Tensor? memory_key_padding_mask=None) -> (Tensor, Tensor, Tensor)",
      TORCH_FN(torchmha::decoder_memory));
  m.def(
      "decoder_reorder(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) lengths, Tensor(d!)? memory_keys, "
      "Tensor(e!)? memory_values, Tensor(f!)? memory_padding, Tensor indices) -> ()",
      TORCH_FN(torchmha::decoder_reorder));
  m.def(
      "decoder_reset(Tensor(a!) lengths, Tensor(b!)? memory_keys, Tensor(c!)? memory_values, "
      "Tensor(d!)? memory_padding, Tensor? slots=None, Tensor? new_keys=None, Tensor? new_values=None, "
      "Tensor? new_padding=None) -> ()",
      TORCH_FN(torchmha::decoder_reset));
  // The step's attention inside attention_with_cache: a kernel per device (decode_attention.h).
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor(c!) lengths, Tensor? new_lengths, Tensor? padding, float dropout_p) -> Tensor");
  // The linear layers of a decoding step, for a few rows of x (small_linear.h).
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // The attention with weights inside multi_head_attention_forward, where no gradient or dropout
  // is needed: a kernel per device (explicit_attention.h).
  m.def("attention_with_weights(Tensor q, Tensor k, Tensor v, Tensor? mask, bool average) -> (Tensor, Tensor)");
  // The attention without weights, where torchmha's kernel beats SDPA (blocked_attention.h).
  m.def("blocked_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal) -> (Tensor, Tensor)");
  m.def(
      "blocked_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, "
      "Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor)");
  m.def(
      "project_key_value(Tensor key, Tensor? value, int num_heads, Tensor? in_proj_weight, Tensor? in_proj_bias, "
      "Tensor? k_proj_weight=None, Tensor? v_proj_weight=None, bool batch_first=False, Tensor? bias_k=None, "
      "Tensor? bias_v=None, bool add_zero_attn=False) -> (Tensor, Tensor)",
      TORCH_FN(torchmha::project_key_value));
  m.def(
      "attention_with_static_key_value(Tensor query, Tensor keys, Tensor values, int num_heads, "
      "Tensor? in_proj_weight, Tensor? in_proj_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor? key_padding_mask=None, float dropout_p=0., bool training=False, bool batch_first=False, "
      "Tensor? q_proj_weight=None, Tensor? bias_k=None, Tensor? bias_v=None, bool add_zero_attn=False) -> Tensor",
      TORCH_FN(torchmha::attention_with_static_key_value));
  // The article's layers (cross_attention.h, transformer_block.h).
  m.def(
      "cross_attention(Tensor x, Tensor keys, Tensor values, int heads, Tensor to_q_weight, Tensor to_out_weight, "
      "Tensor? to_out_bias, Tensor? mask=None, bool training=False) -> Tensor",
      TORCH_FN(torchmha::cross_attention));
  m.def(
      "transformer_block(Tensor x, int num_heads, Tensor in_proj_weight, Tensor? in_proj_bias, "
      "Tensor out_proj_weight, Tensor? out_proj_bias, Tensor linear1_weight, Tensor? linear1_bias, "
      "Tensor linear2_weight, Tensor? linear2_bias, Tensor norm1_weight, Tensor norm1_bias, Tensor norm2_weight, "
      "Tensor norm2_bias, float layer_norm_eps, float attention_dropout, float dropout, bool norm_first, "
      "bool training, Tensor? attn_mask=None, Tensor? key_padding_mask=None, bool allow_fast_path=False) -> Tensor",
      TORCH_FN(torchmha::transformer_block));
}

// decode_attention, small_linear, attention_with_weights and blocked_attention: torchmha's own CPU kernels; the ATen composition
// on every other device and for Meta/fake tensors (tracing). Both serve inference only: they have
// no autograd formula (the core takes the differentiable composition where gradients are needed).
TORCH_LIBRARY_IMPL(torchmha, CPU, m) {
  m.impl("decode_attention", TORCH_FN(torchmha::core::decode_attention_cpu));
  m.impl("small_linear", TORCH_FN(torchmha::core::small_linear_cpu));
  m.impl("attention_with_weights", TORCH_FN(torchmha::core::attention_with_weights_cpu));
  m.impl("blocked_attention", TORCH_FN(torchmha::core::blocked_attention_cpu));
  m.impl("blocked_attention_backward", TORCH_FN(torchmha::core::blocked_attention_backward_cpu));
}

TORCH_LIBRARY_IMPL(torchmha, Meta, m) {
  m.impl("blocked_attention_backward", TORCH_FN(torchmha::core::blocked_attention_backward_meta));
}

TORCH_LIBRARY_IMPL(torchmha, CompositeExplicitAutograd, m) {
  m.impl("decode_attention", TORCH_FN(torchmha::core::decode_attention_reference));
  m.impl("small_linear", TORCH_FN(torchmha::core::small_linear_reference));
  m.impl("attention_with_weights", TORCH_FN(torchmha::core::attention_with_weights_reference));
  m.impl("blocked_attention", TORCH_FN(torchmha::core::blocked_attention_reference));
  m.impl("blocked_attention_backward", TORCH_FN(torchmha::core::blocked_attention_backward_reference));
}
