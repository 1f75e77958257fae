// The public argument structs (attention_arguments.h) in the core's form (arguments.h).

#include "arguments.h"

#include <torchmha/errors.h>

namespace torchmha::core {

AttentionWeights attention_weights(const AttentionParameters& params, bool out_proj_required) {
  AttentionWeights w;
  w.num_heads = params.num_heads;
  w.head_dim = params.head_dim;
  w.in_proj.packed_weight = params.in_proj_weight;
  w.in_proj.packed_bias = params.in_proj_bias;
  if (!w.in_proj.packed()) {  // with the packed weight, torch ignores the separate ones
    w.in_proj.weights = {params.q_proj_weight, params.k_proj_weight, params.v_proj_weight};
  }
  w.in_proj.biases = {params.q_proj_bias, params.k_proj_bias, params.v_proj_bias};
  w.bias_k = params.bias_k;
  w.bias_v = params.bias_v;
  w.add_zero_attn = params.add_zero_attn;
  TORCHMHA_CHECK_ARG(!out_proj_required || is_present(params.out_proj_weight), "out_proj_weight is None: the ",
                     "attention's output projection needs it");
  w.out_weight = params.out_proj_weight.value_or(Tensor());
  w.out_bias = params.out_proj_bias;
  return w;
}

}  // namespace torchmha::core
