// The functional API (functional.h): each function gathers its flat arguments, as the op schemas
// in register_ops.cpp give them, into the core's structs and makes one call into csrc/core.

#include <torchmha/functional.h>

#include "core/cached_attention.h"
#include "core/cached_decoder.h"
#include "core/checks.h"
#include "core/in_projection.h"
#include "core/layers.h"
#include "core/multi_head_attention.h"

#include <torchmha/errors.h>

namespace torchmha {
namespace {

using at::Tensor;
using core::OptionalTensor;

core::AttentionWeights attention_weights(
    int64_t num_heads,
    const OptionalTensor& in_proj_weight,
    const OptionalTensor& in_proj_bias,
    std::array<OptionalTensor, 3> proj_weights,
    std::array<OptionalTensor, 3> proj_biases,
    const OptionalTensor& bias_k,
    const OptionalTensor& bias_v,
    bool add_zero_attn,
    const Tensor& out_proj_weight,
    const OptionalTensor& out_proj_bias) {
  core::AttentionWeights w;
  w.num_heads = num_heads;
  w.in_proj.packed_weight = in_proj_weight;
  w.in_proj.packed_bias = in_proj_bias;
  // With the packed weight, separate weights are ignored, as torch ignores them.
  if (!w.in_proj.packed()) {
    w.in_proj.weights = std::move(proj_weights);
  }
  w.in_proj.biases = std::move(proj_biases);
  w.bias_k = bias_k;
  w.bias_v = bias_v;
  w.add_zero_attn = add_zero_attn;
  w.out_weight = out_proj_weight;
  w.out_bias = out_proj_bias;
  return w;
}

// A functional in-projection's outputs, as the (..., E) tensors torch's functions return.
std::vector<Tensor> split_projections(const std::vector<core::ProjectionGroup>& groups) {
  std::vector<Tensor> projections;
  for (const auto& group : groups) {
    for (auto& part : group.output.chunk(group.parts, -1)) {  // views into the GEMM's output
      projections.push_back(std::move(part));
    }
  }
  return projections;
}

core::Stack stack_of(const c10::List<OptionalTensor>& params, int64_t num_heads,
                     const std::vector<std::string>& activations = {}, const std::vector<bool>& norm_first = {},
                     at::ArrayRef<double> eps = {}, std::optional<double> final_norm_eps = std::nullopt,
                     bool batch_first = false) {
  const std::vector<OptionalTensor> slots(params.begin(), params.end());
  if (activations.empty()) {  // (decoder_memory: only the attentions matter)
    const size_t layers = slots.size() / core::kLayerSlots;
    return core::stack_from_slots(slots, num_heads, std::vector<c10::string_view>(layers, "relu"),
                                  std::vector<bool>(layers, false), std::vector<double>(3 * layers, 1e-5),
                                  std::nullopt, batch_first);
  }
  const std::vector<c10::string_view> names(activations.begin(), activations.end());
  return core::stack_from_slots(slots, num_heads, names, norm_first, eps,
                                final_norm_eps, batch_first);
}

}  // namespace

std::vector<Tensor> in_projection_packed(
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const Tensor& w,
    const OptionalTensor& b) {
  const int64_t E = q.size(-1);
  TORCH_CHECK(
      k.size(-1) == E && v.size(-1) == E, "in_projection_packed: q, k and v must share the embedding size, but got ",
      "q of shape ", q.sizes(), ", k of shape ", k.sizes(), " and v of shape ", v.sizes());
  core::InProjection in_proj{w, b, {}, {}};
  core::check_in_projection(in_proj, E, E, E, E);
  return split_projections(core::project(q, k, v, in_proj, core::sharing_of(q, k, v), /*batch_first=*/false));
}

std::vector<Tensor> in_projection(
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const Tensor& w_q,
    const Tensor& w_k,
    const Tensor& w_v,
    const OptionalTensor& b_q,
    const OptionalTensor& b_k,
    const OptionalTensor& b_v) {
  core::InProjection in_proj{std::nullopt, std::nullopt, {w_q, w_k, w_v}, {b_q, b_k, b_v}};
  const int64_t Eq = q.size(-1);
  core::check_in_projection(in_proj, Eq, Eq, k.size(-1), v.size(-1));
  return split_projections(core::project(q, k, v, in_proj, core::Sharing::kSeparate, /*batch_first=*/false));
}

std::tuple<Tensor, Tensor> multi_head_attention_forward(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    int64_t embed_dim,
    int64_t num_heads,
    const OptionalTensor& in_proj_weight,
    const OptionalTensor& in_proj_bias,
    const OptionalTensor& bias_k,
    const OptionalTensor& bias_v,
    bool add_zero_attn,
    double dropout_p,
    const Tensor& out_proj_weight,
    const OptionalTensor& out_proj_bias,
    bool training,
    const OptionalTensor& key_padding_mask,
    bool need_weights,
    const OptionalTensor& attn_mask,
    const OptionalTensor& q_proj_weight,
    const OptionalTensor& k_proj_weight,
    const OptionalTensor& v_proj_weight,
    bool average_attn_weights,
    bool is_causal,
    bool batch_first,
    bool allow_fast_path,
    const OptionalTensor& q_proj_bias,
    const OptionalTensor& k_proj_bias,
    const OptionalTensor& v_proj_bias,
    const OptionalTensor& static_k,
    const OptionalTensor& static_v) {
  const auto weights = attention_weights(
      num_heads, in_proj_weight, in_proj_bias, {q_proj_weight, k_proj_weight, v_proj_weight},
      {q_proj_bias, k_proj_bias, v_proj_bias}, bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias);
  core::ForwardCall call{query,    key,       value,       key_padding_mask, attn_mask,  static_k,
                         static_v, need_weights, average_attn_weights, is_causal, training, batch_first,
                         dropout_p};
  return core::multi_head_attention(call, weights, embed_dim, allow_fast_path);
}

Tensor attention_with_cache(
    const Tensor& query,
    const Tensor& k_cache,
    const Tensor& v_cache,
    const Tensor& lengths,
    int64_t num_heads,
    const OptionalTensor& in_proj_weight,
    const OptionalTensor& in_proj_bias,
    const Tensor& out_proj_weight,
    const OptionalTensor& out_proj_bias,
    const OptionalTensor& key_padding_mask,
    double dropout_p,
    bool training,
    bool batch_first,
    const OptionalTensor& q_proj_weight,
    const OptionalTensor& k_proj_weight,
    const OptionalTensor& v_proj_weight,
    const OptionalTensor& bias_k,
    const OptionalTensor& bias_v,
    bool add_zero_attn,
    const OptionalTensor& new_lengths) {
  const auto weights = attention_weights(
      num_heads, in_proj_weight, in_proj_bias, {q_proj_weight, k_proj_weight, v_proj_weight}, {}, bias_k, bias_v,
      add_zero_attn, out_proj_weight, out_proj_bias);
  return core::attention_with_cache(
      query, k_cache, v_cache, lengths, new_lengths, weights, {key_padding_mask, dropout_p, training, batch_first});
}

void reorder_cache(const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths, const Tensor& indices) {
  core::reorder_cache(k_cache, v_cache, lengths, indices);
}

void reset_cache(const Tensor& lengths, const OptionalTensor& slots) {
  core::reset_cache(lengths, slots);
}

std::tuple<Tensor, Tensor> project_key_value(
    const Tensor& key,
    const OptionalTensor& value,
    int64_t num_heads,
    const OptionalTensor& in_proj_weight,
    const OptionalTensor& in_proj_bias,
    const OptionalTensor& k_proj_weight,
    const OptionalTensor& v_proj_weight,
    bool batch_first,
    const OptionalTensor& bias_k,
    const OptionalTensor& bias_v,
    bool add_zero_attn) {
  const auto weights = attention_weights(
      num_heads, in_proj_weight, in_proj_bias, {std::nullopt, k_proj_weight, v_proj_weight}, {}, bias_k, bias_v,
      add_zero_attn, /*out_proj_weight=*/Tensor(), std::nullopt);
  return core::project_key_value(key, core::is_present(value) ? *value : key, weights, batch_first);
}

Tensor attention_with_static_key_value(
    const Tensor& query,
    const Tensor& keys,
    const Tensor& values,
    int64_t num_heads,
    const OptionalTensor& in_proj_weight,
    const OptionalTensor& in_proj_bias,
    const Tensor& out_proj_weight,
    const OptionalTensor& out_proj_bias,
    const OptionalTensor& key_padding_mask,
    double dropout_p,
    bool training,
    bool batch_first,
    const OptionalTensor& q_proj_weight,
    const OptionalTensor& bias_k,
    const OptionalTensor& bias_v,
    bool add_zero_attn) {
  const auto weights = attention_weights(
      num_heads, in_proj_weight, in_proj_bias, {q_proj_weight, std::nullopt, std::nullopt}, {}, bias_k, bias_v,
      add_zero_attn, out_proj_weight, out_proj_bias);
  return core::attention_with_static_key_value(
      query, keys, values, weights, {key_padding_mask, dropout_p, training, batch_first});
}

Tensor cross_attention(
    const Tensor& x,
    const Tensor& keys,
    const Tensor& values,
    int64_t heads,
    const Tensor& to_q_weight,
    const Tensor& to_out_weight,
    const OptionalTensor& to_out_bias,
    const OptionalTensor& mask,
    bool training) {
  const auto weights = attention_weights(
      heads, std::nullopt, std::nullopt, {to_q_weight, std::nullopt, std::nullopt}, {}, std::nullopt, std::nullopt,
      false, to_out_weight, to_out_bias);
  return core::cross_attention(x, keys, values, weights, mask, training);
}

Tensor transformer_block(
    const Tensor& x,
    int64_t num_heads,
    const Tensor& in_proj_weight,
    const OptionalTensor& in_proj_bias,
    const Tensor& out_proj_weight,
    const OptionalTensor& out_proj_bias,
    const Tensor& linear1_weight,
    const OptionalTensor& linear1_bias,
    const Tensor& linear2_weight,
    const OptionalTensor& linear2_bias,
    const Tensor& norm1_weight,
    const Tensor& norm1_bias,
    const Tensor& norm2_weight,
    const Tensor& norm2_bias,
    double layer_norm_eps,
    double attention_dropout,
    double dropout,
    bool norm_first,
    bool training,
    const OptionalTensor& attn_mask,
    const OptionalTensor& key_padding_mask,
    bool allow_fast_path) {
  const auto attention = attention_weights(
      num_heads, in_proj_weight, in_proj_bias, {}, {}, std::nullopt, std::nullopt, false, out_proj_weight,
      out_proj_bias);
  const core::FeedForwardWeights ff{linear1_weight, linear1_bias, linear2_weight, linear2_bias, norm1_weight,
                                    norm1_bias,     norm2_weight, norm2_bias,     layer_norm_eps, dropout};
  core::ForwardCall call{x,     x,     x,    key_padding_mask, attn_mask, std::nullopt, std::nullopt,
                         /*need_weights=*/false, true, false, training, /*batch_first=*/true, attention_dropout};
  return core::transformer_block(call, attention, ff, norm_first, allow_fast_path);
}

Tensor decoder_step(
    const Tensor& tgt,
    const c10::List<OptionalTensor>& params,
    const Tensor& keys,
    const Tensor& values,
    const Tensor& lengths,
    const OptionalTensor& memory_keys,
    const OptionalTensor& memory_values,
    const OptionalTensor& memory_padding,
    int64_t num_heads,
    const std::vector<std::string>& activations,
    const c10::List<bool>& norm_first,
    at::ArrayRef<double> eps,
    std::optional<double> final_norm_eps,
    bool batch_first,
    bool training,
    const OptionalTensor& new_lengths) {
  const std::vector<bool> pre_norm(norm_first.begin(), norm_first.end());
  const auto stack = stack_of(params, num_heads, activations, pre_norm, eps, final_norm_eps, batch_first);
  return core::stack_step(tgt, stack, {keys, values, lengths, memory_keys, memory_values, memory_padding}, new_lengths,
                          training);
}

std::tuple<Tensor, Tensor, Tensor> decoder_memory(
    const Tensor& memory,
    const c10::List<OptionalTensor>& params,
    int64_t num_heads,
    bool batch_first,
    const OptionalTensor& memory_key_padding_mask) {
  TORCHMHA_CHECK_ARG(memory.dim() == 3, "CachedDecoder: expected memory of shape ", batch_first ? "(N, S, E)" : "(S, N, E)",
                     ", but got ", memory.sizes());
  auto [keys, values] = core::project_stack_memory(memory, stack_of(params, num_heads, {}, {}, {}, {}, batch_first));
  auto padding = core::memory_padding(memory_key_padding_mask, memory.size(core::batch_dim(batch_first)),
                                      memory.size(core::sequence_dim(batch_first)), keys);
  return {keys, values, padding};
}

void decoder_reorder(
    const Tensor& keys,
    const Tensor& values,
    const Tensor& lengths,
    const OptionalTensor& memory_keys,
    const OptionalTensor& memory_values,
    const OptionalTensor& memory_padding,
    const Tensor& indices) {
  core::reorder_stack_state({keys, values, lengths, memory_keys, memory_values, memory_padding}, indices);
}

void decoder_reset(
    const Tensor& lengths,
    const OptionalTensor& memory_keys,
    const OptionalTensor& memory_values,
    const OptionalTensor& memory_padding,
    const OptionalTensor& slots,
    const OptionalTensor& new_keys,
    const OptionalTensor& new_values,
    const OptionalTensor& new_padding) {
  core::reset_stack_state({Tensor(), Tensor(), lengths, memory_keys, memory_values, memory_padding}, slots, new_keys,
                          new_values, new_padding);
}

}  // namespace torchmha
