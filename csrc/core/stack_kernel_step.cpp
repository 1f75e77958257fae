// A stack's decoding step through torchmha's CPU kernels into buffers made once a step
// (cached_decoder.h: kernel_step). It runs what the composition (stack_step's layer_step) runs,
// the same kernels on the same inputs in the same order, so its results are the composition's bit
// for bit; what it leaves out is the composition's glue. That glue was about 70 ATen calls a layer
// (views to and from heads, narrows, clones of the lengths, every kernel's output allocated, each
// kernel reached through the dispatcher) and cost more than the kernels themselves in a step of a
// small model: 6 layers of d_model 64 took 205 us in C++ with int8 weights, of which the kernels
// took about 50; 102 us this way (AMD EPYC Zen 3, 2 threads; benchmarks/README.md).

#include "cached_decoder.h"

#include "attend.h"
#include "decode_attention.h"
#include "small_linear.h"

#include "common/settings.h"
#include "cpu/kernels.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace torchmha::core {
namespace {

bool enabled() {
  static const bool on = settings::read_switch("TORCHMHA_KERNEL_STEP").value_or(true);
  return on;
}

// The rows the kernels take at once: the small-batch linear's and the residual norm's (kernels.h).
constexpr int64_t kMaxRows = 8;

bool plain(const Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous();
}

bool fits(const OptionalTensor& t, at::IntArrayRef sizes, at::ScalarType dtype) {
  return is_present(t) && plain(*t, dtype) && t->sizes() == sizes;
}

// A weight of these sizes in the model's dtype, or int8 with its scale (checked by stack_from_slots).
bool weight_fits(const Tensor& weight, const OptionalTensor& scale, at::IntArrayRef sizes, at::ScalarType dtype) {
  return fits(weight, sizes, is_present(scale) ? at::kChar : dtype);
}

bool attention_fits(const AttentionWeights& w, int64_t E, at::ScalarType dtype) {
  const auto& in = w.in_proj;
  return in.packed() && weight_fits(*in.packed_weight, in.packed_weight_scale, {3 * E, E}, dtype) &&
      (!is_present(in.packed_bias) || fits(in.packed_bias, {3 * E}, dtype)) &&
      weight_fits(w.out_weight, w.out_weight_scale, {E, E}, dtype) &&
      (!is_present(w.out_bias) || fits(w.out_bias, {E}, dtype)) && !records_grad({*in.packed_weight, w.out_weight});
}

bool norm_fits(const LayerNormWeights& n, int64_t E, at::ScalarType dtype) {
  return (!is_present(n.weight) || fits(n.weight, {E}, dtype)) && (!is_present(n.bias) || fits(n.bias, {E}, dtype));
}

// A layer of the model's sizes and dtype, with an activation of the step's own.
bool layer_fits(const StackLayer& layer, int64_t E, at::ScalarType dtype) {
  const int64_t F = layer.linear1_weight.size(0);
  const bool cross = layer.cross_attn.has_value();
  return layer.activation.kind != Activation::kOp && attention_fits(layer.self_attn, E, dtype) &&
      (!cross || attention_fits(*layer.cross_attn, E, dtype)) &&
      weight_fits(layer.linear1_weight, layer.linear1_weight_scale, {F, E}, dtype) &&
      (!is_present(layer.linear1_bias) || fits(layer.linear1_bias, {F}, dtype)) &&
      weight_fits(layer.linear2_weight, layer.linear2_weight_scale, {E, F}, dtype) &&
      (!is_present(layer.linear2_bias) || fits(layer.linear2_bias, {E}, dtype)) &&
      !records_grad({layer.linear1_weight, layer.linear2_weight}) && norm_fits(layer.norm1, E, dtype) &&
      norm_fits(layer.norm2, E, dtype) && (!cross || norm_fits(layer.norm3, E, dtype));
}

// What the step takes: one new position per sequence, no new_lengths, up to kMaxRows sequences,
// layers with an activation of their own, every tensor on the CPU, contiguous (tgt may be
// strided), in the model's dtype and of the sizes the model implies, nothing that records a
// gradient or is transformed. Anything else is the composition's, with its checks and errors. A
// kernel that declines a call then hands that call to its op (the same result); these conditions
// keep that rare. (A full cache raises the composition's error from the decode kernel's own
// check, in the first layer, before any cache is written.)
bool takes(const Tensor& tgt, const Stack& stack, const StackState& state, const OptionalTensor& new_lengths) {
  const auto dtype = tgt.scalar_type();
  const int64_t L = static_cast<int64_t>(stack.layers.size()), E = tgt.size(-1);
  const int64_t H = stack.layers.front().self_attn.num_heads, N = tgt.size(batch_dim(stack.batch_first));
  if (!enabled() || is_present(new_lengths) || !tgt.device().is_cpu() ||
      tgt.size(sequence_dim(stack.batch_first)) != 1 ||
      (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) || N > kMaxRows ||
      H <= 0 || E % H != 0 || state.keys.dim() != 5) {
    return false;
  }
  const Tensor memory_keys = state.memory_keys.value_or(Tensor());
  const Tensor memory_values = state.memory_values.value_or(Tensor());
  const Tensor padding = state.memory_padding.value_or(Tensor());
  if (transformed({tgt, state.keys, state.values, memory_keys, memory_values, padding}) ||
      records_grad({tgt, state.keys, state.values, memory_keys, memory_values, padding})) {
    return false;
  }
  const int64_t M = state.keys.size(3), D = E / H;
  if (!fits(state.keys, {L, N, H, M, D}, dtype) || !fits(state.values, {L, N, H, M, D}, dtype) ||
      !fits(state.lengths, {N}, at::kLong)) {
    return false;
  }
  if (stack.decoder()) {
    const int64_t S = state.memory_keys->dim() == 5 ? state.memory_keys->size(3) : -1;
    if (!fits(state.memory_keys, {L, N, H, S, D}, dtype) || !fits(state.memory_values, {L, N, H, S, D}, dtype) ||
        (is_present(state.memory_padding) && !fits(state.memory_padding, {N, S}, dtype))) {
      return false;
    }
  }
  return std::all_of(stack.layers.begin(), stack.layers.end(),
                     [&](const StackLayer& layer) { return layer_fits(layer, E, dtype); });
}

// y = x W^T + b into y: the kernel, or the op (linear_layer) where it hands the call back.
void linear_into(const Tensor& x, const Tensor& weight, const OptionalTensor& bias, const OptionalTensor& scale,
                 const Tensor& y) {
  if (!cpu::small_linear_into(x, weight, scale, bias, y)) {
    y.copy_(linear_layer(x, weight, bias, scale).view_as(y));
  }
}

// norm(x + y) into out (x itself): the kernel, or ATen's add and layer_norm.
void add_norm_into(const Tensor& x, const Tensor& y, const LayerNormWeights& n, const Tensor& out) {
  if (!cpu::residual_layer_norm_into(x, y, n.weight, n.bias, n.eps, out)) {
    out.copy_(norm(x + y, n));
  }
}

// A step's buffers, rows (N, features) as views of the heads where the attention reads them.
struct Buffers {
  Tensor x;                  // the running hidden state, tgt's shape
  Tensor qkv, q, k, v;       // the self-attention's packed projection (N, 3E) and its heads (N, H, 1, D)
  Tensor heads, heads_view;  // an attention's output (N, E), as (N, H, 1, D)
  Tensor cross_q, cross_q_view;
  Tensor projected;          // an output projection's or the feed-forward's result, tgt's shape
  Tensor hidden;             // the feed-forward's (N, F)
};

Buffers make_buffers(const Tensor& tgt, const Stack& stack, int64_t num_heads) {
  const int64_t N = tgt.numel() / tgt.size(-1), E = tgt.size(-1), D = E / num_heads;
  int64_t F = 0;
  for (const StackLayer& layer : stack.layers) {
    F = std::max(F, layer.linear1_weight.size(0));
  }
  Buffers b;
  b.x = at::empty(tgt.sizes(), tgt.options());
  b.projected = at::empty(tgt.sizes(), tgt.options());
  b.qkv = at::empty({N, 3 * E}, tgt.options());
  for (int part = 0; part < 3; ++part) {
    (part == 0 ? b.q : part == 1 ? b.k : b.v) = b.qkv.as_strided({N, num_heads, 1, D}, {3 * E, D, 3 * E, 1}, part * E);
  }
  b.heads = at::empty({N, E}, tgt.options());
  b.heads_view = b.heads.view({N, num_heads, 1, D});
  if (stack.decoder()) {
    b.cross_q = at::empty({N, E}, tgt.options());
    b.cross_q_view = b.cross_q.view({N, num_heads, 1, D});
  }
  b.hidden = at::empty({N, F}, tgt.options());
  return b;
}

void self_attention(const Tensor& x, const AttentionWeights& w, const Tensor& keys, const Tensor& values,
                    const StackState& state, Buffers& b) {
  linear_into(x, *w.in_proj.packed_weight, w.in_proj.packed_bias, w.in_proj.packed_weight_scale, b.qkv);
  if (!cpu::decode_attention_into(b.q, b.k, b.v, keys, values, state.lengths, b.heads_view)) {
    const Tensor lengths = state.lengths.clone();  // (the op advances the lengths it gets)
    b.heads_view.copy_(decode_attention(b.q, b.k, b.v, keys, values, lengths, std::nullopt, std::nullopt, 0.0));
  }
  linear_into(b.heads, w.out_weight, w.out_bias, w.out_weight_scale, b.projected);
}

void cross_attention(const Tensor& x, const AttentionWeights& w, const Tensor& keys, const Tensor& values,
                     const OptionalTensor& padding, Buffers& b) {
  const int64_t E = x.size(-1);
  const auto query_rows = [E](const OptionalTensor& t) {
    return is_present(t) ? OptionalTensor(t->narrow(0, 0, E)) : std::nullopt;
  };
  linear_into(x, w.in_proj.packed_weight->narrow(0, 0, E), query_rows(w.in_proj.packed_bias),
              query_rows(w.in_proj.packed_weight_scale), b.cross_q);
  if (!cpu::static_kernel_pays_off(1, keys.size(2)) ||
      !cpu::static_attention_into(b.cross_q_view, keys, values, padding, b.heads_view)) {
    // (the composition's padding: (N, 1, 1, S), as SDPA broadcasts it)
    const OptionalTensor broadcast =
        is_present(padding) ? OptionalTensor(padding->view({keys.size(0), 1, 1, keys.size(2)})) : std::nullopt;
    b.heads_view.copy_(attend_fixed_keys(b.cross_q_view, keys, values, broadcast, 0.0));
  }
  linear_into(b.heads, w.out_weight, w.out_bias, w.out_weight_scale, b.projected);
}

void feed_forward(const Tensor& x, const StackLayer& layer, Buffers& b) {
  const int64_t N = b.hidden.size(0), F = layer.linear1_weight.size(0);
  const Tensor hidden = F == b.hidden.size(1) ? b.hidden : b.hidden.view(-1).narrow(0, 0, N * F).view({N, F});
  linear_into(x, layer.linear1_weight, layer.linear1_bias, layer.linear1_weight_scale, hidden);
  const Tensor activated = activate(hidden, layer.activation);  // (in place)
  linear_into(activated, layer.linear2_weight, layer.linear2_bias, layer.linear2_weight_scale, b.projected);
}

// The kernel step's blocks (run_layer): each writes its result into b.projected, each residual
// into b.x, in place (post-norm: the norm kernel; pre-norm: ATen's add_ after tgt is copied in).
struct KernelBlocks {
  const StackLayer& layer;
  int64_t index;
  const StackState& state;
  Buffers& b;

  const Tensor& self_attention(const Tensor& y) const {
    core::self_attention(y, layer.self_attn, state.keys.select(0, index), state.values.select(0, index), state, b);
    return b.projected;
  }
  const Tensor& cross_attention(const Tensor& y) const {
    core::cross_attention(y, *layer.cross_attn, state.memory_keys->select(0, index),
                          state.memory_values->select(0, index), state.memory_padding, b);
    return b.projected;
  }
  const Tensor& feed_forward(const Tensor& y) const {
    core::feed_forward(y, layer, b);
    return b.projected;
  }
  const Tensor& add(const Tensor& x, const Tensor& y) const {
    if (!x.is_same(b.x)) {
      b.x.copy_(x);  // (tgt, in the first layer)
    }
    return b.x.add_(y);
  }
  const Tensor& add_norm(const Tensor& x, const Tensor& y, const LayerNormWeights& n) const {
    add_norm_into(x, y, n, b.x);
    return b.x;
  }
};

}  // namespace

std::optional<Tensor> kernel_step(const Tensor& tgt, const Stack& stack, const StackState& state,
                                  const OptionalTensor& new_lengths) {
  if (!takes(tgt, stack, state, new_lengths)) {
    return std::nullopt;
  }
  Buffers b = make_buffers(tgt, stack, stack.layers.front().self_attn.num_heads);
  Tensor x = tgt.contiguous();  // (then b.x, written in place by every layer)
  for (size_t l = 0; l < stack.layers.size(); ++l) {
    KernelBlocks blocks{stack.layers[l], static_cast<int64_t>(l), state, b};
    x = run_layer(x, stack.layers[l], blocks);
  }
  if (stack.final_norm.has_value()) {
    x = norm(x, *stack.final_norm);
  }
  state.lengths.add_(1);
  return x;
}

}  // namespace torchmha::core
