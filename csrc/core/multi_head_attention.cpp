// The attention core (multi_head_attention.h). Semantics follow torch.nn.MultiheadAttention
// (torch/nn/functional.py, torch/nn/modules/activation.py); the tests compare with the installed torch.

#include "multi_head_attention.h"

#include "attend.h"
#include "checks.h"
#include "fast_path.h"
#include "in_projection.h"

#include <torchmha/errors.h>

#include <ATen/autocast_mode.h>

namespace torchmha::core {
namespace {

// Unbatched (2-D) inputs gain a batch dimension of 1; identity was taken before (sharing_of).
Tensor batched(const Tensor& x, bool is_batched, bool batch_first) {
  return is_batched ? x : x.unsqueeze(batch_dim(batch_first));
}

// attn_mask (L, S) or (N*H, L, S) as a 4-D view broadcastable to (N, H, L, S).
OptionalTensor attn_mask_4d(const OptionalTensor& mask, const Geometry& g, int64_t num_heads) {
  if (!is_present(mask)) {
    return std::nullopt;
  }
  return mask->dim() == 2 ? mask->view({1, 1, g.tgt_len, g.src_len})
                          : mask->view({g.batch, num_heads, g.tgt_len, g.src_len});
}

// Under autocast the projections come out in the autocast dtype while the masks stay as given;
// autocast casts them for baddbmm and SDPA inside torch's module, so the same here.
OptionalTensor autocast_mask(const OptionalTensor& mask, at::ScalarType dtype) {
  if (!is_present(mask) || !at::autocast::is_autocast_enabled(mask->device().type())) {
    return mask;
  }
  return mask->to(dtype);
}


}  // namespace

std::tuple<Tensor, Tensor> multi_head_attention(
    const ForwardCall& call,
    const AttentionWeights& weights,
    int64_t embed_dim) {
  // torch's module forward: the masks' kinds (its _canonical_mask), its fused path, then the
  // functional forward's checks.
  check_mask_kind(call.key_padding_mask, "key_padding_mask");
  check_mask_kind(call.attn_mask, "attn_mask");

  // fused fast path
  const std::string why_not_fused = why_not_fast_path(call, weights, call.allow_fast_path);
  // (torch names no reason for a missing in_proj_bias, but does not fuse without it either; nor
  // does it know of a head size of the caller's)
  const bool torch_fuses =
      why_not_fused.empty() && is_present(weights.in_proj.packed_bias) && !weights.head_dim.has_value();
  if (torch_fuses && !sdpa_beats_fast_path(call) && !weights_kernel_beats_fast_path(call, embed_dim, weights.num_heads)) {
    return fused_forward(call, weights, embed_dim);
  }
  TORCHMHA_CHECK_ARG(
      !call.query.is_nested() && !call.key.is_nested() && !call.value.is_nested(),
      "MultiheadAttention does not support NestedTensor outside of its fast path. The fast path was not hit because ",
      why_not_fused);
  if (torch_fuses) {
    check_fused_embedding(call, embed_dim);
  }

  // validate
  const Geometry g = validate_forward(call, weights, embed_dim);
  const Sharing sharing = sharing_of(call.query, call.key, call.value);
  const auto dtype = call.query.scalar_type();
  OptionalTensor attn_mask = additive_mask(call.attn_mask, dtype);
  OptionalTensor padding = additive_mask(call.key_padding_mask, dtype);

  // project
  const bool batch_first = call.batch_first;
  const Tensor query = batched(call.query, g.batched, batch_first);
  const Tensor key = batched(call.key, g.batched, batch_first);
  const Tensor value = batched(call.value, g.batched, batch_first);
  check_in_projection(weights.in_proj, weights.num_heads * g.head_dim, embed_dim, key.size(-1), value.size(-1));
  auto [q, k, v] = project_to_heads(query, key, value, weights.in_proj, sharing, weights.num_heads, batch_first);

  // Without a padding mask or weights, SDPA applies causality itself and the mask is never read
  // (torch does not even check its shape); the fast path above still uses it. Otherwise the
  // mask is applied as given (merged with a padding mask it is no longer just causal).
  const bool causal = call.is_causal && !is_present(padding) && !call.need_weights;
  check_mask_shapes(call, weights, g, /*attn_mask_is_read=*/!causal);

  // static keys and values replace the projected ones (functional API)
  if (is_present(call.static_k)) {
    k = call.static_k->reshape({g.batch, weights.num_heads, call.static_k->size(1), g.head_dim});
  }
  if (is_present(call.static_v)) {
    v = call.static_v->reshape({g.batch, weights.num_heads, call.static_v->size(1), g.head_dim});
  }

  // extra key positions
  KeysValues kv{k, v, causal ? std::nullopt : attn_mask_4d(attn_mask, g, weights.num_heads),
                is_present(padding) ? OptionalTensor(padding->view({g.batch, padding->size(-1)})) : std::nullopt};
  kv = append_extra_key_positions(std::move(kv), weights);
  const int64_t total_src_len = kv.keys.size(2);
  OptionalTensor mask = add_masks(
      kv.attn_mask, is_present(kv.padding_mask) ? OptionalTensor(kv.padding_mask->view({g.batch, 1, 1, total_src_len}))
                                                : std::nullopt);
  mask = autocast_mask(mask, q.scalar_type());
  check_mask_dtype(mask, q.scalar_type());

  // attend (the heads in the order the output projection reads them: project_output)
  const double p = call.effective_dropout();
  const bool batch_major = output_reads_batch_major(batch_first, /*contiguous=*/torch_fuses);
  Tensor heads, attn_weights;
  if (call.need_weights) {
    std::tie(heads, attn_weights) =
        attend_with_weights(q, kv.keys, kv.values, mask, p, call.average_attn_weights, batch_major);
    if (!g.batched) {
      attn_weights = attn_weights.squeeze(0);
    }
  } else {
    heads = attend(q, kv.keys, kv.values, mask, p, /*is_causal=*/causal, batch_major);
  }

  // output projection
  auto output = project_output(heads, weights, batch_first, /*contiguous=*/torch_fuses);
  if (!g.batched) {
    output = output.squeeze(batch_dim(batch_first));
  }
  return std::make_tuple(output, attn_weights);
}

}  // namespace torchmha::core
