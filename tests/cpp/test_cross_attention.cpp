// CrossAttention (cross_attention.h).

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;

TEST(CrossAttention, InnerWidthMaskAndCache) {
  torch::manual_seed(3);
  torchmha::CrossAttention attn(torchmha::CrossAttentionOptions(10).context_dim(6).heads(3).dim_head(5));
  attn->to(torch::kFloat64);
  EXPECT_EQ(attn->to_q->weight.sizes(), torch::IntArrayRef({15, 10}));
  EXPECT_FALSE(attn->to_k->bias.defined());
  auto x = torch::randn({2, 4, 10}, f64());
  auto context = torch::randn({2, 7, 6}, f64());
  auto keep = torch::ones({2, 7}, torch::kBool);
  keep.select(0, 1).narrow(0, 3, 4).fill_(false);

  // Reference in plain ATen: scale dim_head^-0.5, mask true = keep.
  auto split = [](const Tensor& t) { return t.unflatten(-1, {3, 5}).transpose(1, 2); };
  auto q = split(torch::matmul(x, attn->to_q->weight.t()));
  auto k = split(torch::matmul(context, attn->to_k->weight.t()));
  auto v = split(torch::matmul(context, attn->to_v->weight.t()));
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(5.0);
  scores = scores.masked_fill(keep.logical_not().view({2, 1, 1, 7}), -INFINITY);
  auto heads = torch::matmul(scores.softmax(-1), v).transpose(1, 2).flatten(2);
  auto expected = torch::linear(heads, attn->to_out->weight, attn->to_out->bias);

  expect_close(attn(x, context, keep), expected);
  expect_close(attn->forward_with_cache(x, attn->project_context(context), keep), expected);
  EXPECT_THROW(attn(x), torchmha::ArgumentError);  // context defaults to x, of width 10, not context_dim 6
  EXPECT_THROW(attn(x, context, keep.to(torch::kFloat64)), torchmha::ArgumentError);
}

}  // namespace
