#pragma once

// What every attention op receives, in the core's form: the module's parameters grouped by step
// (AttentionWeights, built from the public AttentionParameters by attention_weights) and one
// forward call's inputs with its AttentionOptions (ForwardCall).

#include "common.h"
#include "in_projection.h"

#include <torchmha/attention_arguments.h>

namespace torchmha::core {

/// A module's parameters, in torch.nn.MultiheadAttention's form.
struct AttentionWeights {
  int64_t num_heads = 1;
  std::optional<int64_t> head_dim;  // absent: embed_dim / num_heads
  InProjection in_proj;
  OptionalTensor bias_k, bias_v;  // (1, 1, E): one more key/value position each
  bool add_zero_attn = false;     // one more all-zero key/value position
  Tensor out_weight;              // out_proj (E_out, inner)
  OptionalTensor out_bias;
  OptionalTensor out_weight_scale;  // with an int8 out_weight (small_linear.h)

  bool has_extra_key_positions() const { return is_present(bias_k) || is_present(bias_v) || add_zero_attn; }
};

/// One call of forward: inputs, and the masks and flags of AttentionOptions.
struct ForwardCall : AttentionOptions {
  Tensor query, key, value;

  ForwardCall(Tensor query_, Tensor key_, Tensor value_, AttentionOptions options)
      : AttentionOptions(std::move(options)), query(std::move(query_)), key(std::move(key_)), value(std::move(value_)) {}
};

/// The core's form of a module's parameters. With the packed weight, separate weights are ignored,
/// as torch ignores them. `out_proj_required`: the op projects its output (all but
/// project_key_value), so a missing out_proj_weight is an error naming it.
AttentionWeights attention_weights(const AttentionParameters& params, bool out_proj_required = true);

}  // namespace torchmha::core
