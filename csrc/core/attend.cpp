// Masks, extra key positions, attention and the output projection (attend.h).

#include "attend.h"

#include "small_linear.h"

#include "blocked_attention.h"
#include "decode_attention.h"
#include "explicit_attention.h"
#include "in_projection.h"

#include "cpu/kernels.h"

#include <ATen/TensorOperators.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace torchmha::core {
namespace {

OptionalTensor pad_last_dim(const OptionalTensor& mask) {
  return is_present(mask) ? OptionalTensor(at::constant_pad_nd(*mask, {0, 1}, 0)) : std::nullopt;
}

// One more position along the length of (N, H, len, D), from `row` (1, 1, H * D).
Tensor append_position(const Tensor& heads, const Tensor& row) {
  const int64_t N = heads.size(0), H = heads.size(1), D = heads.size(3);
  return at::cat({heads, row.reshape({1, H, 1, D}).expand({N, H, 1, D})}, 2);
}

}  // namespace

OptionalTensor additive_mask(const OptionalTensor& mask, at::ScalarType dtype) {
  if (!is_present(mask) || mask->scalar_type() != at::kBool) {
    return mask;
  }
  return at::zeros_like(*mask, mask->options().dtype(dtype))
      .masked_fill_(*mask, -std::numeric_limits<double>::infinity());
}

OptionalTensor add_masks(const OptionalTensor& a, const OptionalTensor& b) {
  if (!is_present(a)) {
    return b;
  }
  return is_present(b) ? OptionalTensor(*a + *b) : a;
}

OptionalTensor padding_bias(const OptionalTensor& key_padding_mask, int64_t batch, const c10::SymInt& src_len,
                            at::ScalarType dtype) {
  auto additive = additive_mask(key_padding_mask, dtype);
  if (!is_present(additive)) {
    return std::nullopt;
  }
  return additive->view_symint({batch, 1, 1, src_len});
}

KeysValues append_extra_key_positions(KeysValues kv, const AttentionWeights& weights) {
  if (is_present(weights.bias_k)) {
    kv.keys = append_position(kv.keys, *weights.bias_k);
    kv.values = append_position(kv.values, *weights.bias_v);
    kv.attn_mask = pad_last_dim(kv.attn_mask);
    kv.padding_mask = pad_last_dim(kv.padding_mask);
  }
  if (weights.add_zero_attn) {  // one all-zero key/value position: a zero pad of the length
    kv.keys = at::constant_pad_nd(kv.keys, {0, 0, 0, 1}, 0);
    kv.values = at::constant_pad_nd(kv.values, {0, 0, 0, 1}, 0);
    kv.attn_mask = pad_last_dim(kv.attn_mask);
    kv.padding_mask = pad_last_dim(kv.padding_mask);
  }
  return kv;
}

bool transformed(std::initializer_list<Tensor> tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const Tensor& t) {
    return t.defined() && (t._fw_grad(/*level=*/0).defined() || at::isTensorSubclassLike(t));
  });
}

bool records_grad(std::initializer_list<Tensor> tensors) {
  return at::GradMode::is_enabled() &&
      std::any_of(tensors.begin(), tensors.end(), [](const Tensor& t) { return t.defined() && t.requires_grad(); });
}

Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask, double dropout_p,
              bool is_causal, bool batch_major) {
  // torchmha's blocked kernel where it beats SDPA here; it draws no dropout, knows no transform and
  // gives no mask gradient.
  const Tensor mask_or_none = is_present(mask) ? *mask : Tensor();
  const bool with_grad = records_grad({q, k, v});
  if (dropout_p > 0.0 || transformed({q, k, v, mask_or_none}) || records_grad({mask_or_none}) ||
      !cpu::blocked_kernel_applies(q, k, v, mask) || !cpu::blocked_kernel_pays_off(q, k, is_causal, with_grad)) {
    const bool copies = cpu::sdpa_takes_contiguous_heads(q, k, is_causal, with_grad);
    const auto heads = [copies](const Tensor& t) { return copies ? t.contiguous() : t; };
    return at::scaled_dot_product_attention(heads(q), heads(k), heads(v), mask, dropout_p, is_causal);
  }
  return with_grad ? blocked_attention_differentiable(q, k, v, mask, is_causal)
                   : std::get<0>(blocked_attention(q, k, v, mask, is_causal, batch_major));
}

Tensor attend_fixed_keys(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& padding,
                         double dropout_p) {
  const Tensor padding_or_none = is_present(padding) ? *padding : Tensor();
  if (dropout_p > 0.0 || transformed({q, k, v, padding_or_none}) || records_grad({q, k, v, padding_or_none}) ||
      !cpu::static_kernel_pays_off(q.size(2), k.size(2))) {
    return attend(q, k, v, padding, dropout_p);
  }
  const OptionalTensor rows = is_present(padding) ? OptionalTensor(padding->reshape({q.size(0), k.size(2)})) : std::nullopt;
  return static_attention(q, k, v, rows);
}

std::pair<Tensor, Tensor> attend_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const OptionalTensor& mask, double dropout_p, bool average,
                                              bool batch_major) {
  // The kernels draw no dropout and know no transform; a float mask that needs its gradient is
  // left to the composition too (the kernels' backward gives none), and so are small heads.
  const Tensor mask_or_none = is_present(mask) ? *mask : Tensor();
  if (dropout_p > 0.0 || transformed({q, k, v, mask_or_none}) || records_grad({mask_or_none}) ||
      !cpu::explicit_kernel_pays_off(q.size(2), k.size(2))) {
    return attention_with_weights_composition(q, k, v, mask, dropout_p, average);
  }
  if (!records_grad({q, k, v})) {
    return attention_with_weights(q, k, v, mask, average, batch_major);  // the op: a kernel per device
  }
  if (cpu::explicit_kernel_applies(q, k, v, mask)) {
    return attention_with_weights_differentiable(q, k, v, mask, average);
  }
  return attention_with_weights_composition(q, k, v, mask, dropout_p, average);
}

Tensor project_output(const Tensor& heads, const AttentionWeights& weights, bool batch_first, bool contiguous) {
  // torch's slow path computes the output sequence first, (L, N, E), and returns batch_first as its
  // transposed view; its fused path returns (N, L, E) contiguous. The same strides here, so a
  // dropout after the attention draws the same mask under a seed.
  if (output_reads_batch_major(batch_first, contiguous)) {
    return linear_layer(heads.transpose(1, 2).flatten(-2), weights.out_weight, weights.out_bias,
                        weights.out_weight_scale);
  }
  auto output = linear_layer(merge_heads(heads), weights.out_weight, weights.out_bias, weights.out_weight_scale);
  return batch_first ? output.transpose(0, 1) : output;
}

}  // namespace torchmha::core
