#pragma once

// What every attention op receives, grouped once: the module's parameters (AttentionWeights) and
// one forward call's inputs and flags (ForwardCall). The ops in register_ops.cpp take them as
// flat schema arguments and build these.

#include "common.h"
#include "in_projection.h"

namespace torchmha::core {

/// A module's parameters, in torch.nn.MultiheadAttention's form.
struct AttentionWeights {
  int64_t num_heads = 1;
  InProjection in_proj;
  OptionalTensor bias_k, bias_v;  // (1, 1, E): one more key/value position each
  bool add_zero_attn = false;     // one more all-zero key/value position
  Tensor out_weight;              // out_proj (E_out, inner)
  OptionalTensor out_bias;

  bool has_extra_key_positions() const { return is_present(bias_k) || is_present(bias_v) || add_zero_attn; }
};

/// One call of forward: inputs, masks and flags.
struct ForwardCall {
  Tensor query, key, value;
  OptionalTensor key_padding_mask, attn_mask;
  OptionalTensor static_k, static_v;  // (N*H, S, D): keys/values used instead of the projected ones
  bool need_weights = true;
  bool average_attn_weights = true;
  bool is_causal = false;
  bool training = true;
  bool batch_first = false;
  double dropout_p = 0.0;

  double effective_dropout() const { return training ? dropout_p : 0.0; }
};

}  // namespace torchmha::core
