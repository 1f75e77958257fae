// The functional API (functional.h): each function gathers its flat arguments, as the op schemas
// in register_ops.cpp give them, into the core's structs and makes one call into csrc/core.

#include <torchmha/functional.h>

#include "core/cached_attention.h"
#include "core/cached_decoder.h"
#include "core/checks.h"
#include "core/in_projection.h"
#include "core/layers.h"
#include "core/multi_head_attention.h"
#include "core/small_linear.h"

#include <torchmha/errors.h>

namespace torchmha {
namespace {

using at::Tensor;

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

core::Stack stack_of(const c10::List<OptionalTensor>& params, const c10::List<OptionalTensor>& weight_scales,
                     int64_t num_heads, const std::vector<std::string>& activations = {},
                     const std::vector<bool>& norm_first = {}, at::ArrayRef<double> eps = {},
                     std::optional<double> final_norm_eps = std::nullopt, bool batch_first = false) {
  const std::vector<OptionalTensor> slots(params.begin(), params.end());
  const std::vector<OptionalTensor> scales(weight_scales.begin(), weight_scales.end());
  if (activations.empty()) {  // (decoder_memory: only the attentions matter)
    const size_t layers = slots.size() / core::kLayerSlots;
    return core::stack_from_slots(slots, scales, num_heads, std::vector<c10::string_view>(layers, "relu"),
                                  std::vector<bool>(layers, false), std::vector<double>(3 * layers, 1e-5),
                                  std::nullopt, batch_first);
  }
  const std::vector<c10::string_view> names(activations.begin(), activations.end());
  return core::stack_from_slots(slots, scales, num_heads, names, norm_first, eps, final_norm_eps, batch_first);
}

}  // namespace

std::vector<Tensor> in_projection_packed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w,
    const OptionalTensor& b) {
  const int64_t E = q.size(-1);
  TORCH_CHECK(
      k.size(-1) == E && v.size(-1) == E, "in_projection_packed: q, k and v must share the embedding size, but got ",
      "q of shape ", q.sizes(), ", k of shape ", k.sizes(), " and v of shape ", v.sizes());
  core::InProjection in_proj{w, b, {}, {}};
  core::check_in_projection(in_proj, E, E, E, E);
  return split_projections(core::project(q, k, v, in_proj, core::sharing_of(q, k, v), /*batch_first=*/false));
}

std::vector<Tensor> in_projection(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w_q,
    const Tensor& w_k, const Tensor& w_v, const OptionalTensor& b_q, const OptionalTensor& b_k,
    const OptionalTensor& b_v) {
  core::InProjection in_proj{std::nullopt, std::nullopt, {w_q, w_k, w_v}, {b_q, b_k, b_v}};
  const int64_t Eq = q.size(-1);
  core::check_in_projection(in_proj, Eq, Eq, k.size(-1), v.size(-1));
  return split_projections(core::project(q, k, v, in_proj, core::Sharing::kSeparate, /*batch_first=*/false));
}

std::tuple<Tensor, Tensor> multi_head_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
    int64_t embed_dim, const AttentionParameters& params, const AttentionOptions& options) {
  return core::multi_head_attention({query, key, value, options}, core::attention_weights(params), embed_dim);
}

Tensor attention_with_cache(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
    const AttentionParameters& params, const DecodingOptions& options, const OptionalTensor& new_lengths) {
  return core::attention_with_cache(query, k_cache, v_cache, lengths, new_lengths, core::attention_weights(params),
                                    options);
}

void reorder_cache(const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths, const Tensor& indices) {
  core::reorder_cache(k_cache, v_cache, lengths, indices);
}

void reset_cache(const Tensor& lengths, const OptionalTensor& slots) {
  core::reset_cache(lengths, slots);
}

std::tuple<Tensor, Tensor> project_key_value(const Tensor& key, const OptionalTensor& value,
    const AttentionParameters& params, bool batch_first) {
  const auto weights = core::attention_weights(params, /*out_proj_required=*/false);
  return core::project_key_value(key, is_present(value) ? *value : key, weights, batch_first);
}

Tensor attention_with_static_key_value(const Tensor& query, const Tensor& keys, const Tensor& values,
    const AttentionParameters& params, const DecodingOptions& options) {
  return core::attention_with_static_key_value(query, keys, values, core::attention_weights(params), options);
}

Tensor cross_attention(const Tensor& x, const Tensor& keys, const Tensor& values, const AttentionParameters& params,
    const OptionalTensor& mask, bool training) {
  return core::cross_attention(x, keys, values, core::attention_weights(params), mask, training);
}

Tensor transformer_block(const Tensor& x, const FeedForwardParameters& feed_forward,
    const AttentionParameters& attention, const BlockOptions& options) {
  AttentionOptions self_attention;
  self_attention.key_padding_mask = options.key_padding_mask;
  self_attention.attn_mask = options.attn_mask;
  self_attention.need_weights = false;
  self_attention.is_causal = options.is_causal;
  self_attention.training = options.training;
  self_attention.batch_first = true;
  self_attention.dropout_p = options.dropout_p;
  self_attention.allow_fast_path = options.allow_fast_path;
  return core::transformer_block({x, x, x, self_attention}, core::attention_weights(attention), feed_forward);
}

Tensor decoder_step(const Tensor& tgt, const c10::List<OptionalTensor>& params, const DecoderCache& cache,
    int64_t num_heads, const std::vector<std::string>& activations, const c10::List<bool>& norm_first,
    at::ArrayRef<double> eps, std::optional<double> final_norm_eps, bool batch_first, bool training,
    const OptionalTensor& new_lengths, const c10::List<OptionalTensor>& weight_scales) {
  const std::vector<bool> pre_norm(norm_first.begin(), norm_first.end());
  const auto stack = stack_of(params, weight_scales, num_heads, activations, pre_norm, eps, final_norm_eps, batch_first);
  return core::stack_step(tgt, stack, cache, new_lengths, training);
}

std::tuple<Tensor, Tensor, Tensor> decoder_memory(const Tensor& memory, const c10::List<OptionalTensor>& params,
    int64_t num_heads, bool batch_first, const OptionalTensor& memory_key_padding_mask,
    const c10::List<OptionalTensor>& weight_scales) {
  TORCHMHA_CHECK_ARG(memory.dim() == 3, "CachedDecoder: expected memory of shape ", batch_first ? "(N, S, E)" : "(S, N, E)",
                     ", but got ", memory.sizes());
  auto [keys, values] = core::project_stack_memory(memory, stack_of(params, weight_scales, num_heads, {}, {}, {}, {}, batch_first));
  auto padding = core::memory_padding(memory_key_padding_mask, memory.size(core::batch_dim(batch_first)),
                                      memory.size(core::sequence_dim(batch_first)), keys);
  return {keys, values, padding};
}

std::tuple<Tensor, Tensor> quantize_weight(const Tensor& weight) {
  return core::quantize_weight(weight);
}

std::tuple<c10::List<OptionalTensor>, c10::List<OptionalTensor>> decoder_quantize(
    const c10::List<OptionalTensor>& params) {
  const std::vector<OptionalTensor> slots(params.begin(), params.end());
  auto [weights, scales] = core::quantize_stack_weights(slots);
  return {c10::List<OptionalTensor>(weights), c10::List<OptionalTensor>(scales)};
}

void decoder_reorder(const DecoderCache& cache, const Tensor& indices) {
  core::reorder_stack_state(cache, indices);
}

void decoder_reset(const DecoderCache& cache, const OptionalTensor& slots, const OptionalTensor& new_keys,
    const OptionalTensor& new_values, const OptionalTensor& new_padding) {
  core::reset_stack_state(cache, slots, new_keys, new_values, new_padding);
}

}  // namespace torchmha
