// The fused fast path (fast_path.h).

#include "fast_path.h"

#include <ATen/autocast_mode.h>

#include <atomic>
#include <ATen/ops/_native_multi_head_attention.h>
#include <c10/core/GradMode.h>

namespace torchmha {
namespace {

std::atomic<bool> fast_path_switch{true};
thread_local std::optional<bool> fast_path_override;

}  // namespace

void set_fast_path_enabled(bool enabled) {
  fast_path_switch = enabled;
}

bool fast_path_enabled() {
  return fast_path_override.value_or(fast_path_switch.load());
}

namespace core {

FastPathOverride::FastPathOverride(bool enabled) : previous_(fast_path_override) {
  fast_path_override = enabled;
}

FastPathOverride::~FastPathOverride() {
  fast_path_override = previous_;
}

namespace {

bool on_fast_path_device(const OptionalTensor& t) {
  if (!is_present(t)) {
    return true;
  }
  const auto type = t->device().type();
  return type == at::kCPU || type == at::kCUDA || type == at::kPrivateUse1;
}

bool needs_grad(const OptionalTensor& t) {
  return is_present(t) && t->requires_grad();
}

bool is_float(const OptionalTensor& t) {
  return is_present(t) && t->is_floating_point();
}

}  // namespace

bool torch_takes_fast_path(const ForwardCall& call, const AttentionWeights& w) {
  const auto& query = call.query;
  const auto& in_proj = w.in_proj;
  if (!(query.dim() == 3 && call.batch_first && !call.training && query.is_same(call.key) &&
        call.key.is_same(call.value))) {
    return false;
  }
  if (!in_proj.packed() || !is_present(in_proj.packed_bias) || w.has_extra_key_positions() || w.num_heads % 2 != 0 ||
      is_present(call.static_k) || is_present(call.static_v)) {
    return false;
  }
  if (query.scalar_type() != in_proj.packed_weight->scalar_type() ||
      query.scalar_type() != in_proj.packed_bias->scalar_type()) {
    return false;
  }
  // Float masks are not supported there; bool masks are.
  if (is_float(call.attn_mask) || is_float(call.key_padding_mask)) {
    return false;
  }
  if (query.is_nested() || at::autocast::is_autocast_enabled(query.device().type())) {
    return false;
  }
  for (const auto& t : {OptionalTensor(query), in_proj.packed_weight, in_proj.packed_bias,
                        OptionalTensor(w.out_weight), w.out_bias}) {
    if (!on_fast_path_device(t)) {
      return false;
    }
  }
  return !(c10::GradMode::is_enabled() &&
           (query.requires_grad() || needs_grad(in_proj.packed_weight) || needs_grad(in_proj.packed_bias) ||
            w.out_weight.requires_grad() || needs_grad(w.out_bias)));
}

bool sdpa_beats_fast_path(const ForwardCall& call) {
  // Without weights and masks our SDPA path gives torch's numbers (no fully masked rows can
  // differ) and is faster than the fused kernel, which does not use flash attention on CPU.
  return !call.need_weights && !is_present(call.key_padding_mask) && !is_present(call.attn_mask);
}

std::tuple<Tensor, Tensor> fused_forward(
    const ForwardCall& call,
    const AttentionWeights& w,
    const Geometry& g,
    int64_t embed_dim,
    const OptionalTensor& attn_mask,
    const OptionalTensor& padding_mask) {
  // torch's merge_masks: type 1 = padding only (N, S), type 2 = (N, H, L, S).
  const int64_t N = g.batch, H = w.num_heads, L = g.tgt_len, S = g.src_len;
  std::optional<int64_t> mask_type;
  OptionalTensor merged;
  if (is_present(padding_mask)) {
    mask_type = 1;
    merged = padding_mask;
  }
  if (is_present(attn_mask)) {
    mask_type = 2;
    merged = attn_mask->dim() == 3 ? attn_mask->view({N, H, L, S})
                                   : attn_mask->view({1, 1, L, S}).expand({N, H, L, S});
    if (is_present(padding_mask)) {
      merged = *merged + padding_mask->view({N, 1, 1, S});
    }
  }
  return at::_native_multi_head_attention(
      call.query, call.key, call.value, embed_dim, H, *w.in_proj.packed_weight, *w.in_proj.packed_bias, w.out_weight,
      w.out_bias.value_or(Tensor()), merged, call.need_weights, call.average_attn_weights, mask_type);
}

}  // namespace core
}  // namespace torchmha
