// Masks, extra key positions, attention and the output projection (attend.h).

#include "attend.h"

#include "explicit_attention.h"
#include "in_projection.h"

#include <ATen/TensorOperators.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros_like.h>

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

Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask, double dropout_p,
              bool is_causal) {
  return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal);
}

namespace {

// No gradient (reverse or forward mode) is recorded through these tensors, and none is wrapped
// by a function transform (vmap, jvp) or seen by a dispatch mode: an op without an autograd
// formula or batching rule may run on them.
bool plain_inference(std::initializer_list<Tensor> tensors) {
  for (const Tensor& t : tensors) {
    if (t.defined() && ((at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined() ||
                        at::isTensorSubclassLike(t))) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::pair<Tensor, Tensor> attend_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const OptionalTensor& mask, double dropout_p, bool average) {
  // The op has no autograd formula and draws no dropout: where either is needed, or under a
  // function transform, the composition.
  if (dropout_p > 0.0 || !plain_inference({q, k, v, is_present(mask) ? *mask : Tensor()})) {
    return attention_with_weights_composition(q, k, v, mask, dropout_p, average);
  }
  return attention_with_weights(q, k, v, mask, average);
}

Tensor project_output(const Tensor& heads, const AttentionWeights& weights, bool batch_first, bool contiguous) {
  // torch's slow path computes the output sequence first, (L, N, E), and returns batch_first as its
  // transposed view; its fused path returns (N, L, E) contiguous. The same strides here, so a
  // dropout after the attention draws the same mask under a seed.
  if (batch_first && contiguous) {
    return at::linear(heads.transpose(1, 2).flatten(-2), weights.out_weight, weights.out_bias);
  }
  auto output = at::linear(merge_heads(heads), weights.out_weight, weights.out_bias);
  return batch_first ? output.transpose(0, 1) : output;
}

}  // namespace torchmha::core
