// CrossAttention's and TransformerBlock's computations (layers.h).

#include "layers.h"

#include "multi_head_attention.h"
#include "small_linear.h"

#include <torchmha/errors.h>

#include <ATen/TensorOperators.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/relu.h>

namespace torchmha::core {

Tensor cross_attention(const Tensor& x, const Tensor& keys, const Tensor& values, const AttentionWeights& weights,
                       const OptionalTensor& mask, bool training) {
  DecodingCall call;
  call.training = training;
  call.batch_first = true;
  if (is_present(mask)) {
    TORCHMHA_CHECK_ARG(
        mask->scalar_type() == at::kBool, "CrossAttention's mask must be bool (true = keep), but got dtype ",
        mask->scalar_type());
    call.key_padding_mask = at::logical_not(*mask);  // the core takes torch's convention, true = ignore
  }
  return attention_with_static_key_value(x, keys, values, weights, call);
}

Tensor transformer_block(const ForwardCall& call, const AttentionWeights& attention, const FeedForwardWeights& ff) {
  const double p = call.training ? ff.dropout_p : 0.0;
  const int64_t embed_dim = call.query.size(-1);
  auto attend = [&](const Tensor& y) {
    ForwardCall self = call;
    self.query = self.key = self.value = y;
    return at::dropout(std::get<0>(multi_head_attention(self, attention, embed_dim)), p, call.training);
  };
  auto feed_forward = [&](const Tensor& y) {
    auto hidden = at::dropout(at::relu(linear_layer(y, ff.linear1_weight, ff.linear1_bias)), p, call.training);
    return at::dropout(linear_layer(hidden, ff.linear2_weight, ff.linear2_bias), p, call.training);
  };
  auto norm1 = [&](const Tensor& y) {
    return at::layer_norm(y, {embed_dim}, ff.norm1_weight, ff.norm1_bias, ff.layer_norm_eps);
  };
  auto norm2 = [&](const Tensor& y) {
    return at::layer_norm(y, {embed_dim}, ff.norm2_weight, ff.norm2_bias, ff.layer_norm_eps);
  };
  const Tensor& x = call.query;
  if (ff.norm_first) {
    auto h = x + attend(norm1(x));
    return h + feed_forward(norm2(h));
  }
  auto h = norm1(x + attend(x));
  return norm2(h + feed_forward(h));
}

void check_cross_attention_sizes(int64_t query_dim, int64_t context_dim, int64_t heads, int64_t dim_head) {
  TORCH_CHECK_VALUE(
      query_dim > 0 && context_dim > 0 && heads > 0 && dim_head > 0,
      "CrossAttention sizes must be greater than 0, got query_dim=", query_dim, ", context_dim=", context_dim,
      ", heads=", heads, ", dim_head=", dim_head);
}

void check_forward_expansion(int64_t forward_expansion) {
  TORCH_CHECK_VALUE(forward_expansion > 0, "forward_expansion must be greater than 0, but got ", forward_expansion);
}

}  // namespace torchmha::core
