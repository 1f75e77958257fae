// The fused fast path (fast_path.h).

#include "fast_path.h"

#include "attend.h"
#include "explicit_attention.h"

#include "common/settings.h"
#include "cpu/kernels.h"

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

namespace {

// Python's name of a dtype (torch.float32), as torch's reasons print it.
std::string python_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    default: return c10::str("torch.", c10::toString(type));
  }
}

// torch's reasons that do not look at a tensor's device or autograd state, in torch's order.
std::string why_not_by_configuration(const ForwardCall& call, const AttentionWeights& w) {
  const auto& query = call.query;
  const auto& in_proj = w.in_proj;
  if (query.dim() != 3) {
    return c10::str("input not batched; expected query.dim() of 3 but got ", query.dim());
  }
  if (!query.is_same(call.key) || !call.key.is_same(call.value)) {
    return "non-self attention was used (query, key, and value are not the same Tensor)";
  }
  if (is_present(in_proj.packed_bias) && query.scalar_type() != in_proj.packed_bias->scalar_type()) {
    return c10::str("dtypes of query (", python_dtype(query.scalar_type()), ") and self.in_proj_bias (",
                    python_dtype(in_proj.packed_bias->scalar_type()), ") don't match");
  }
  if (!in_proj.packed()) {
    return "in_proj_weight was None";
  }
  if (query.scalar_type() != in_proj.packed_weight->scalar_type()) {
    return c10::str("dtypes of query (", python_dtype(query.scalar_type()), ") and self.in_proj_weight (",
                    python_dtype(in_proj.packed_weight->scalar_type()), ") don't match");
  }
  if (call.training) return "training is enabled";
  if (w.num_heads % 2 != 0) return "self.num_heads is not even";
  if (!call.batch_first) return "batch_first was not True";
  if (is_present(w.bias_k)) return "self.bias_k was not None";
  if (is_present(w.bias_v)) return "self.bias_v was not None";
  if (w.add_zero_attn) return "add_zero_attn was enabled";
  if (query.is_nested() && (is_present(call.key_padding_mask) || is_present(call.attn_mask))) {
    return "supplying both src_key_padding_mask and src_mask at the same time "
           "                                 is not supported with NestedTensor input";
  }
  if (at::autocast::is_autocast_enabled(query.device().type())) return "autocast is enabled";
  return "";
}

}  // namespace

std::string why_not_fast_path(const ForwardCall& call, const AttentionWeights& w, bool allowed) {
  // As in torch, a float mask is the reason unless a later condition also fails.
  std::string why = is_float(call.attn_mask) || is_float(call.key_padding_mask)
      ? "floating-point masks are not supported for fast path."
      : "";
  if (!allowed) {
    return "torch.backends.mha.get_fastpath_enabled() was not True";
  }
  if (auto reason = why_not_by_configuration(call, w); !reason.empty()) {
    return reason;
  }
  if (!why.empty()) {
    return why;
  }
  const auto& in_proj = w.in_proj;
  const OptionalTensor tensors[] = {call.query, in_proj.packed_weight, in_proj.packed_bias, w.out_weight, w.out_bias};
  for (const auto& t : tensors) {
    if (!on_fast_path_device(t)) {
      return "some Tensor argument's device is neither one of cpu, cuda or privateuseone";
    }
  }
  if (c10::GradMode::is_enabled()) {
    for (const auto& t : tensors) {
      if (needs_grad(t)) {
        return "grad is enabled and at least one of query or the input/output projection weights or biases "
               "requires_grad";
      }
    }
  }
  return "";
}

bool sdpa_beats_fast_path(const ForwardCall& call) {
  // Without weights and masks our SDPA path gives torch's numbers (no fully masked rows can
  // differ) and is faster than the fused kernel, which does not use flash attention on CPU.
  // (Nested tensors stay with the fused kernel, which takes them, and so does is_causal, which
  // torch's fused path ignores.) TORCHMHA_FAST_PATH_SDPA=0 keeps the fused kernel.
  static const bool allowed = settings::read_switch("TORCHMHA_FAST_PATH_SDPA").value_or(true);
  return allowed && !call.need_weights && !is_present(call.key_padding_mask) && !is_present(call.attn_mask) &&
      !call.query.is_nested() && !call.is_causal;
}

bool weights_kernel_beats_fast_path(const ForwardCall& call, int64_t embed_dim, int64_t num_heads) {
  // (benchmarks/run.py, case fast_path: the fused kernel materializes and masks the per-head
  // weights, and its masked softmax is slower than its own slow path on CPU.)
  // TORCHMHA_FAST_PATH_WEIGHTS_KERNEL: 0 keeps the fused kernel, 1 takes ours at every size.
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_FAST_PATH_WEIGHTS_KERNEL");
  const Tensor& query = call.query;
  if (forced == false || !call.need_weights || query.is_nested() ||
      !cpu::explicit_kernel_serves(query.device(), query.scalar_type())) {
    return false;
  }
  // Well-formed: (N, L, E) self-attention with masks in the shapes merge_masks expects, not
  // causal (the fused path takes is_causal only with a mask, which it then applies as given).
  const int64_t N = query.size(0), L = query.size(1);
  const auto& padding = call.key_padding_mask;
  const auto& mask = call.attn_mask;
  return N > 0 && L > 0 && query.size(2) == embed_dim && !call.is_causal &&
      (forced.value_or(false) || cpu::explicit_kernel_pays_off(L, L)) &&
      (!is_present(padding) || padding->sizes() == at::IntArrayRef{N, L}) &&
      (!is_present(mask) || mask->sizes() == at::IntArrayRef{L, L} ||
       mask->sizes() == at::IntArrayRef{N * num_heads, L, L});
}

void check_fused_embedding(const ForwardCall& call, int64_t embed_dim) {
  TORCH_CHECK(
      call.query.size(-1) == embed_dim, "passed-in embed_dim ", embed_dim, " didn't match last dim of query ",
      call.query.size(-1));
}

std::tuple<Tensor, Tensor> fused_forward(const ForwardCall& call, const AttentionWeights& w, int64_t embed_dim) {
  // torch's merge_masks, view for view (so a malformed mask fails as in torch): type 1 = padding
  // only (N, S), type 2 = (N, H, L, S). Masks are made additive first, as torch's forward does.
  const auto dtype = call.query.scalar_type();
  const OptionalTensor attn_mask = additive_mask(call.attn_mask, dtype);
  const OptionalTensor padding_mask = additive_mask(call.key_padding_mask, dtype);
  const int64_t H = w.num_heads;
  std::optional<int64_t> mask_type;
  OptionalTensor merged;
  if (is_present(padding_mask)) {
    mask_type = 1;
    merged = padding_mask;
  }
  if (is_present(attn_mask)) {
    const int64_t N = call.query.size(0), L = call.query.size(1);
    mask_type = 2;
    merged = attn_mask->dim() == 3 ? attn_mask->view({N, -1, L, L})
                                   : attn_mask->view({1, 1, L, L}).expand({N, H, -1, -1});
    if (is_present(padding_mask)) {
      merged = *merged + padding_mask->view({N, 1, 1, L}).expand({-1, H, -1, -1});
    }
  }
  return at::_native_multi_head_attention(
      call.query, call.key, call.value, embed_dim, H, *w.in_proj.packed_weight, *w.in_proj.packed_bias, w.out_weight,
      w.out_bias.value_or(Tensor()), merged, call.need_weights, call.average_attn_weights, mask_type);
}

}  // namespace core
}  // namespace torchmha
