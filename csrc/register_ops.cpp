// The one place torchmha's ops are registered with the dispatcher (torch.ops.torchmha.*).
// This translation unit lives in libtorchmha, which the Python extension and C++ programs both
// load, so TORCH_LIBRARY runs once per process. Each op is a function of the functional API
// (functional.h). The kernels are CompositeImplicitAutograd: written in differentiable ATen ops,
// they get autograd, fake/meta tensors and torch.compile for free.
//
// The attention ops take the argument structs of attention_arguments.h (a module's parameters in
// torch.nn.MultiheadAttention's form, a call's masks and flags): their schemas are written from
// the structs' for_each_field and their boxed kernels below read the structs back, so a new
// argument is named once in C++ (op_arguments.h).

#include <torchmha/functional.h>

#include "op_arguments.h"

#include "core/blocked_attention.h"
#include "core/decode_attention.h"
#include "core/explicit_attention.h"
#include "core/small_linear.h"

#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

namespace torchmha::ops {
namespace {

using at::Tensor;
using c10::OperatorHandle;
using torch::jit::Stack;

// The boxed kernels of the ops that take argument structs: leading tensors, the structs, the rest.
void multi_head_attention_forward_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  auto query = in.next<Tensor>(), key = in.next<Tensor>(), value = in.next<Tensor>();
  const auto embed_dim = in.next<int64_t>();
  const auto params = in.next_struct<AttentionParameters>();
  auto [output, weights] = multi_head_attention_forward(query, key, value, embed_dim, params,
                                                        in.next_struct<AttentionOptions>());
  in.finish(std::move(output), std::move(weights));
}

void attention_with_cache_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  auto query = in.next<Tensor>(), k_cache = in.next<Tensor>(), v_cache = in.next<Tensor>();
  auto lengths = in.next<Tensor>();
  const auto params = in.next_struct<AttentionParameters>();
  const auto options = in.next_struct<DecodingOptions>();
  in.finish(attention_with_cache(query, k_cache, v_cache, lengths, params, options,
                                 in.next<std::optional<Tensor>>()));
}

void attention_with_static_key_value_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  auto query = in.next<Tensor>(), keys = in.next<Tensor>(), values = in.next<Tensor>();
  const auto params = in.next_struct<AttentionParameters>();
  in.finish(attention_with_static_key_value(query, keys, values, params, in.next_struct<DecodingOptions>()));
}

void project_key_value_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  auto key = in.next<Tensor>();
  auto value = in.next<std::optional<Tensor>>();
  const auto params = in.next_struct<AttentionParameters>();
  auto [keys, values] = project_key_value(key, value, params, in.next<bool>());
  in.finish(std::move(keys), std::move(values));
}

void cross_attention_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  auto x = in.next<Tensor>(), keys = in.next<Tensor>(), values = in.next<Tensor>();
  const auto params = in.next_struct<AttentionParameters>();
  auto mask = in.next<std::optional<Tensor>>();
  in.finish(cross_attention(x, keys, values, params, mask, in.next<bool>()));
}

void transformer_block_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  auto x = in.next<Tensor>();
  const auto feed_forward = in.next_struct<FeedForwardParameters>();
  const auto attention = in.next_struct<AttentionParameters>();
  in.finish(transformer_block(x, feed_forward, attention, in.next_struct<BlockOptions>()));
}

// The weight scales of the decoder ops (an optional list: a schema's list default must be None).
c10::List<std::optional<Tensor>> scales_or_none(std::optional<c10::List<std::optional<Tensor>>> scales) {
  return scales.has_value() ? *std::move(scales) : c10::List<std::optional<Tensor>>();
}

std::tuple<Tensor, Tensor, Tensor> decoder_memory_op(const Tensor& memory, const c10::List<std::optional<Tensor>>& params,
                                                     int64_t num_heads, bool batch_first,
                                                     const std::optional<Tensor>& memory_key_padding_mask,
                                                     std::optional<c10::List<std::optional<Tensor>>> weight_scales) {
  return decoder_memory(memory, params, num_heads, batch_first, memory_key_padding_mask,
                        scales_or_none(std::move(weight_scales)));
}

void decoder_step_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  auto tgt = in.next<Tensor>();
  auto params = in.next<c10::List<std::optional<Tensor>>>();
  const auto cache = in.next_struct<DecoderCache>();
  const auto num_heads = in.next<int64_t>();
  const auto activations = in.next<std::vector<std::string>>();
  const auto norm_first = in.next<c10::List<bool>>();
  const auto eps = in.next<std::vector<double>>();
  const auto final_norm_eps = in.next<std::optional<double>>();
  const auto batch_first = in.next<bool>(), training = in.next<bool>();
  auto new_lengths = in.next<std::optional<Tensor>>();
  in.finish(decoder_step(tgt, params, cache, num_heads, activations, norm_first, eps, final_norm_eps, batch_first,
                         training, new_lengths, scales_or_none(in.next<std::optional<c10::List<std::optional<Tensor>>>>())));
}

void decoder_reorder_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  const auto cache = in.next_struct<DecoderCache>();
  decoder_reorder(cache, in.next<Tensor>());
  in.finish();
}

void decoder_reset_boxed(const OperatorHandle& op, Stack* stack) {
  StackArguments in(op, stack);
  const auto cache = in.next_struct<DecoderCache>();
  auto slots = in.next<std::optional<Tensor>>(), new_keys = in.next<std::optional<Tensor>>();
  auto new_values = in.next<std::optional<Tensor>>(), new_padding = in.next<std::optional<Tensor>>();
  decoder_reset(cache, slots, new_keys, new_values, new_padding);
  in.finish();
}

// Defines op `name(arguments) -> returns` with a boxed kernel (a CompositeImplicitAutograd one, as
// TORCH_FN's in m.def).
template <void (*kernel)(const OperatorHandle&, Stack*)>
void define(torch::Library& m, const char* name, const std::string& arguments, const char* returns) {
  m.def(torch::schema((std::string(name) + "(" + arguments + ") -> " + returns).c_str()));
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<kernel>());
}

}  // namespace
}  // namespace torchmha::ops

TORCH_LIBRARY(torchmha, m) {
  using namespace torchmha;
  using ops::declarations;
  m.def(
      "in_projection_packed(Tensor q, Tensor k, Tensor v, Tensor w, Tensor? b=None) -> Tensor[]",
      TORCH_FN(in_projection_packed));
  m.def(
      "in_projection(Tensor q, Tensor k, Tensor v, Tensor w_q, Tensor w_k, Tensor w_v, "
      "Tensor? b_q=None, Tensor? b_k=None, Tensor? b_v=None) -> Tensor[]",
      TORCH_FN(in_projection));
  ops::define<ops::multi_head_attention_forward_boxed>(
      m, "multi_head_attention_forward",
      "Tensor query, Tensor key, Tensor value, int embed_dim" + declarations<AttentionParameters>() +
          declarations<AttentionOptions>(),
      "(Tensor, Tensor)");
  // Decoding. attention_with_cache writes the step's keys and values into the caches in place,
  // which the schema declares (a!)/(b!).
  ops::define<ops::attention_with_cache_boxed>(
      m, "attention_with_cache",
      "Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) lengths" + declarations<AttentionParameters>() +
          declarations<DecodingOptions>() + ", Tensor? new_lengths=None",
      "Tensor");
  m.def(
      "reorder_cache(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) lengths, Tensor indices) -> ()",
      TORCH_FN(reorder_cache));
  m.def("reset_cache(Tensor(a!) lengths, Tensor? slots=None) -> ()", TORCH_FN(reset_cache));
  // Cached generation through a stack of torch's Transformer layers (functional.h: the parameter
  // list's order). The step writes the caches and advances lengths in place.
  ops::define<ops::decoder_step_boxed>(
      m, "decoder_step",
      "Tensor tgt, Tensor?[] params" + declarations<DecoderCache>() +
          ", int num_heads, str[] activations, bool[] norm_first, float[] eps, float? final_norm_eps, "
          "bool batch_first, bool training, Tensor? new_lengths=None, Tensor?[]? weight_scales=None",
      "Tensor");
  m.def(
      "decoder_memory(Tensor memory, Tensor?[] params, int num_heads, bool batch_first, "
      "Tensor? memory_key_padding_mask=None, Tensor?[]? weight_scales=None) -> (Tensor, Tensor, Tensor)",
      TORCH_FN(ops::decoder_memory_op));
  // int8 weights for decoding (small_linear.h): made once per weight, then read by the layers.
  m.def("quantize_weight(Tensor weight) -> (Tensor, Tensor)", TORCH_FN(quantize_weight));
  m.def("decoder_quantize(Tensor?[] params) -> (Tensor?[], Tensor?[])", TORCH_FN(decoder_quantize));
  ops::define<ops::decoder_reorder_boxed>(m, "decoder_reorder", declarations<DecoderCache>().substr(2) + ", Tensor indices",
                                          "()");
  // A reset empties sequences (lengths) and may replace their memory; it never touches the caches.
  ops::define<ops::decoder_reset_boxed>(
      m, "decoder_reset",
      declarations<DecoderCache>({"keys", "values"}).substr(2) +
          ", Tensor? slots=None, Tensor? new_keys=None, Tensor? new_values=None, Tensor? new_padding=None",
      "()");
  // The step's attention inside attention_with_cache: a kernel per device (decode_attention.h).
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor(c!) lengths, Tensor? new_lengths, Tensor? padding, float dropout_p) -> Tensor");
  // Its attention over fixed keys and values (a decoder's memory): the same kernel, nothing written.
  m.def("static_attention(Tensor q, Tensor keys, Tensor values, Tensor? padding) -> Tensor");
  // The linear layers of a decoding step, for a few rows of x (small_linear.h).
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("quantized_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  // The attention with weights inside multi_head_attention_forward, where no gradient or dropout
  // is needed: a kernel per device (explicit_attention.h).
  // batch_major: the heads in (N, L, H, D) memory rather than (L, N, H, D) (common/heads_layout.h).
  m.def(
      "attention_with_weights(Tensor q, Tensor k, Tensor v, Tensor? mask, bool average, bool batch_major=False) -> "
      "(Tensor, Tensor)");
  // The attention without weights, where torchmha's kernel beats SDPA (blocked_attention.h).
  m.def(
      "blocked_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, bool batch_major=False) -> "
      "(Tensor, Tensor)");
  m.def(
      "blocked_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, "
      "Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor)");
  ops::define<ops::project_key_value_boxed>(
      m, "project_key_value", "Tensor key, Tensor? value" + declarations<AttentionParameters>() + ", bool batch_first=False",
      "(Tensor, Tensor)");
  ops::define<ops::attention_with_static_key_value_boxed>(
      m, "attention_with_static_key_value",
      "Tensor query, Tensor keys, Tensor values" + declarations<AttentionParameters>() + declarations<DecodingOptions>(),
      "Tensor");
  // The article's layers (cross_attention.h, transformer_block.h).
  ops::define<ops::cross_attention_boxed>(
      m, "cross_attention",
      "Tensor x, Tensor keys, Tensor values" + declarations<AttentionParameters>() +
          ", Tensor? mask=None, bool training=False",
      "Tensor");
  ops::define<ops::transformer_block_boxed>(
      m, "transformer_block",
      "Tensor x" + declarations<FeedForwardParameters>() + declarations<AttentionParameters>() +
          declarations<BlockOptions>(),
      "Tensor");
}

// decode_attention, small_linear, attention_with_weights and blocked_attention: torchmha's own CPU kernels; the ATen composition
// on every other device and for Meta/fake tensors (tracing). Both serve inference only: they have
// no autograd formula (the core takes the differentiable composition where gradients are needed;
// decode_attention, which the core calls under grad mode too, refuses a backward below).
TORCH_LIBRARY_IMPL(torchmha, CPU, m) {
  m.impl("decode_attention", TORCH_FN(torchmha::core::decode_attention_cpu));
  m.impl("static_attention", TORCH_FN(torchmha::core::static_attention_cpu));
  m.impl("small_linear", TORCH_FN(torchmha::core::small_linear_cpu));
  m.impl("quantized_linear", TORCH_FN(torchmha::core::quantized_linear_cpu));
  m.impl("attention_with_weights", TORCH_FN(torchmha::core::attention_with_weights_cpu));
  m.impl("blocked_attention", TORCH_FN(torchmha::core::blocked_attention_cpu));
  m.impl("blocked_attention_backward", TORCH_FN(torchmha::core::blocked_attention_backward_cpu));
}

// decode_attention has no derivative: torch's not-implemented kernel makes a backward through it
// an error ("derivative for torchmha::decode_attention is not implemented"; the default fallback
// only warned and returned gradients that left the attention out).
TORCH_LIBRARY_IMPL(torchmha, Autograd, m) {
  m.impl("decode_attention", torch::autograd::autogradNotImplementedFallback());
  m.impl("static_attention", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(torchmha, Meta, m) {
  m.impl("blocked_attention_backward", TORCH_FN(torchmha::core::blocked_attention_backward_meta));
}

TORCH_LIBRARY_IMPL(torchmha, CompositeExplicitAutograd, m) {
  m.impl("decode_attention", TORCH_FN(torchmha::core::decode_attention_reference));
  m.impl("static_attention", TORCH_FN(torchmha::core::static_attention_reference));
  m.impl("small_linear", TORCH_FN(torchmha::core::small_linear_reference));
  m.impl("quantized_linear", TORCH_FN(torchmha::core::quantized_linear_reference));
  m.impl("attention_with_weights", TORCH_FN(torchmha::core::attention_with_weights_reference));
  m.impl("blocked_attention", TORCH_FN(torchmha::core::blocked_attention_reference));
  m.impl("blocked_attention_backward", TORCH_FN(torchmha::core::blocked_attention_backward_reference));
}
