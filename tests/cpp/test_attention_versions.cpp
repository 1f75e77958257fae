// The article's v1-v4 (attention_versions.h): shapes, names, parity with the full module and with
// LibTorch's torch::nn::MultiheadAttention, dropout, gradients in pure C++, clone(), bad sizes.

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;

TEST(Versions, ShapesAndParameterNames) {
  torchmha::MultiheadAttentionV1 v1(16);
  torchmha::MultiheadAttentionV2 v2(torchmha::MultiheadAttentionV2Options(16, 4).dropout(0.1));
  torchmha::MultiheadAttentionV3 v3(torchmha::MultiheadAttentionV3Options(16, 4).kdim(5).vdim(7));
  torchmha::MultiheadAttentionV4 v4(16, 2);
  auto x = torch::randn({6, 3, 16});
  EXPECT_EQ(v1(x).sizes(), x.sizes());
  EXPECT_EQ(v2(x).sizes(), x.sizes());
  auto y = v3(x, torch::randn({9, 3, 5}), torch::randn({9, 3, 7}));
  EXPECT_EQ(y.sizes(), x.sizes());
  auto memory = torch::randn({9, 3, 16});
  EXPECT_EQ(v4(x, memory, memory).sizes(), x.sizes());

  std::vector<std::string> names;
  for (const auto& p : v3->named_parameters()) {
    names.push_back(p.key());
  }
  const std::vector<std::string> expected = {
      "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
      "v_proj.weight", "v_proj.bias", "out_proj.weight", "out_proj.bias"};
  EXPECT_EQ(names, expected);
  EXPECT_EQ(v3->k_proj->weight.sizes(), torch::IntArrayRef({16, 5}));
  EXPECT_EQ(v4->in_proj->weight.sizes(), torch::IntArrayRef({48, 16}));
}

// v1 is v2 with one head; v2 is v3 with kdim = vdim = E; all equal the full module.
TEST(Versions, AgreeWithFullModuleOnSameWeights) {
  torch::manual_seed(0);
  const int64_t E = 12, H = 3;
  torchmha::MultiheadAttentionV3 v3(torchmha::MultiheadAttentionV3Options(E, H).kdim(5).vdim(7));
  torchmha::MultiheadAttention full(torchmha::MultiheadAttentionOptions(E, H).kdim(5).vdim(7));
  v3->to(torch::kFloat64);
  full->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    full->q_proj_weight.copy_(v3->q_proj->weight);
    full->k_proj_weight.copy_(v3->k_proj->weight);
    full->v_proj_weight.copy_(v3->v_proj->weight);
    full->in_proj_bias.copy_(torch::cat({v3->q_proj->bias, v3->k_proj->bias, v3->v_proj->bias}));
    full->out_proj->weight.copy_(v3->out_proj->weight);
    full->out_proj->bias.copy_(v3->out_proj->bias);
  }
  auto q = torch::randn({4, 2, E}, f64());
  auto k = torch::randn({6, 2, 5}, f64());
  auto v = torch::randn({6, 2, 7}, f64());
  auto mask = torch::rand({4, 6}) > 0.7;
  mask.select(1, 0).fill_(false);  // keep every row attendable
  auto [expected, weights] = full->forward(q, k, v, {}, /*need_weights=*/false, mask);
  expect_close(v3(q, k, v, mask), expected);
  EXPECT_FALSE(weights.defined());
}

TEST(Versions, V4MatchesLibTorchModule) {
  torch::manual_seed(1);
  torchmha::MultiheadAttentionV4 v4(8, 2);
  v4->to(torch::kFloat64);
  torch::nn::MultiheadAttention theirs(torch::nn::MultiheadAttentionOptions(8, 2));
  theirs->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    theirs->in_proj_weight.copy_(v4->in_proj->weight);
    theirs->in_proj_bias.copy_(v4->in_proj->bias);
    theirs->out_proj->weight.copy_(v4->out_proj->weight);
    theirs->out_proj->bias.copy_(v4->out_proj->bias);
  }
  auto x = torch::randn({5, 3, 8}, f64());
  auto memory = torch::randn({7, 3, 8}, f64());
  // Self-attention, encoder-decoder (key is value) and general attention.
  expect_close(v4(x, x, x), std::get<0>(theirs(x, x, x)));
  expect_close(v4(x, memory, memory), std::get<0>(theirs(x, memory, memory)));
  auto value = torch::randn({7, 3, 8}, f64());
  expect_close(v4(x, memory, value), std::get<0>(theirs(x, memory, value)));
}

TEST(Versions, DropoutOnlyInTraining) {
  torch::manual_seed(2);
  torchmha::MultiheadAttentionV2 with_dropout(torchmha::MultiheadAttentionV2Options(8, 2).dropout(0.5));
  auto x = torch::randn({10, 2, 8});
  with_dropout->eval();
  auto a = with_dropout(x);
  auto b = with_dropout(x);
  EXPECT_TRUE(torch::equal(a, b));
  with_dropout->train();
  auto c = with_dropout(x);
  EXPECT_FALSE(torch::allclose(a, c));
}

TEST(Versions, GradientsInPureCpp) {
  torch::manual_seed(3);
  torchmha::MultiheadAttentionV4 v4(8, 2);
  auto x = torch::randn({4, 2, 8}, torch::requires_grad());
  auto y = v4(x, x, x).pow(2).sum();
  auto grads = torch::autograd::grad({y}, {x, v4->in_proj->weight, v4->out_proj->bias});
  ASSERT_EQ(grads.size(), 3u);
  for (const auto& g : grads) {
    ASSERT_TRUE(g.defined());
    EXPECT_GT(g.abs().sum().item<double>(), 0.0);
  }
  // Finite differences in float64 on a small case.
  torchmha::MultiheadAttentionV2 v2(4, 2);
  v2->to(torch::kFloat64);
  auto z = torch::randn({3, 1, 4}, f64().requires_grad(true));
  auto out = v2(z).sum();
  auto dz = torch::autograd::grad({out}, {z})[0];
  const double eps = 1e-6;
  torch::NoGradGuard no_grad;
  auto zp = z.detach().clone();
  zp[1][0][2] += eps;
  auto zm = z.detach().clone();
  zm[1][0][2] -= eps;
  const double numeric = (v2(zp).sum() - v2(zm).sum()).item<double>() / (2 * eps);
  EXPECT_NEAR(dz[1][0][2].item<double>(), numeric, 1e-6);
}

TEST(Versions, CloneIsIndependent) {
  torchmha::MultiheadAttentionV1 v1(8);
  auto copy = std::dynamic_pointer_cast<torchmha::MultiheadAttentionV1Impl>(v1->clone());
  ASSERT_TRUE(copy);
  auto x = torch::randn({3, 2, 8});
  EXPECT_TRUE(torch::allclose(copy->forward(x), v1(x)));
  {
    torch::NoGradGuard no_grad;
    copy->q_proj->weight.add_(1.0);
  }
  EXPECT_FALSE(torch::allclose(copy->forward(x), v1(x)));
  EXPECT_FALSE(copy->q_proj->weight.is_same(v1->q_proj->weight));
}

TEST(Versions, BadSizesThrow) {
  EXPECT_THROW(torchmha::MultiheadAttentionV2(10, 3), torchmha::ArgumentError);
  EXPECT_THROW(torchmha::MultiheadAttentionV4(8, 0), c10::ValueError);
  torchmha::MultiheadAttentionV3 v3(torchmha::MultiheadAttentionV3Options(8, 2).kdim(3));
  auto q = torch::randn({4, 2, 8});
  // key with the wrong feature size for k_proj
  EXPECT_THROW(v3(q, torch::randn({5, 2, 8}), torch::randn({5, 2, 8})), c10::Error);
  // key and value lengths differ
  torchmha::MultiheadAttentionV4 v4(8, 2);
  EXPECT_THROW(v4(q, torch::randn({5, 2, 8}), torch::randn({6, 2, 8})), torchmha::ArgumentError);
  // mask of the wrong shape
  EXPECT_THROW(v4(q, q, q, torch::zeros({3, 4}, torch::kBool)), c10::Error);
  // rank 4 input
  EXPECT_THROW(v4(q.unsqueeze(0), q.unsqueeze(0), q.unsqueeze(0)), torchmha::ArgumentError);
}

}  // namespace
