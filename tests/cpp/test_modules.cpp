// GoogleTest suite for the C++ API: module shapes and options, gradients in pure C++,
// clone() independence, Sequential/AnyModule use, errors, and parity with LibTorch's own
// torch::nn::MultiheadAttention where their features overlap.

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;

// LibTorch's own module with the same weights as a torchmha one (packed, bias, no extras).
torch::nn::MultiheadAttention libtorch_copy(torchmha::MultiheadAttention& ours) {
  const auto& o = ours->options;
  torch::nn::MultiheadAttention theirs(torch::nn::MultiheadAttentionOptions(o.embed_dim(), o.num_heads()));
  theirs->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  theirs->in_proj_weight.copy_(ours->in_proj_weight);
  theirs->in_proj_bias.copy_(ours->in_proj_bias);
  theirs->out_proj->weight.copy_(ours->out_proj->weight);
  theirs->out_proj->bias.copy_(ours->out_proj->bias);
  return theirs;
}

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

TEST(InProjectionPacked, CasesByIdentity) {
  const int64_t E = 6;
  auto w = torch::randn({3 * E, E}, f64());
  auto b = torch::randn({3 * E}, f64());
  auto q = torch::randn({4, 2, E}, f64());
  auto kv = torch::randn({5, 2, E}, f64());
  auto expect_projection = [&](const std::vector<Tensor>& out, const Tensor& qq, const Tensor& kk, const Tensor& vv,
                               const Tensor& bias) {
    ASSERT_EQ(out.size(), 3u);
    auto part = [&](const Tensor& x, int64_t i) {
      return torch::linear(x, w.narrow(0, i * E, E), bias.defined() ? bias.narrow(0, i * E, E) : Tensor());
    };
    expect_close(out[0], part(qq, 0));
    expect_close(out[1], part(kk, 1));
    expect_close(out[2], part(vv, 2));
  };
  expect_projection(torchmha::in_projection_packed(q, q, q, w, b), q, q, q, b);
  expect_projection(torchmha::in_projection_packed(q, kv, kv, w, b), q, kv, kv, b);
  // Equal values but different tensors: the general case, same numbers; and no bias.
  auto kv_copy = kv.clone();
  expect_projection(torchmha::in_projection_packed(q, kv, kv_copy, w), q, kv, kv_copy, Tensor());
}

TEST(MultiheadAttention, ParameterNamesFollowTorch) {
  torchmha::MultiheadAttention packed(torchmha::MultiheadAttentionOptions(8, 2).add_bias_kv(true));
  std::vector<std::string> names;
  for (const auto& p : packed->named_parameters()) {
    names.push_back(p.key());
  }
  EXPECT_EQ(
      names,
      (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj.weight", "out_proj.bias"}));
  torchmha::MultiheadAttention separate(torchmha::MultiheadAttentionOptions(8, 2).kdim(3).bias(false));
  names.clear();
  for (const auto& p : separate->named_parameters()) {
    names.push_back(p.key());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}));
  EXPECT_EQ(separate->k_proj_weight.sizes(), torch::IntArrayRef({8, 3}));
}

TEST(MultiheadAttention, MatchesLibTorchWithWeightsAndMasks) {
  torch::manual_seed(4);
  torchmha::MultiheadAttention ours(torchmha::MultiheadAttentionOptions(12, 3));
  ours->to(torch::kFloat64);
  auto theirs = libtorch_copy(ours);
  auto q = torch::randn({5, 2, 12}, f64());
  auto kv = torch::randn({7, 2, 12}, f64());
  auto kpm = torch::zeros({2, 7}, torch::kBool);
  kpm[0][6] = true;
  kpm[1][0] = true;
  auto float_mask = torch::randn({5, 7}, f64());
  for (bool average : {true, false}) {
    auto [y, w] = ours(q, kv, kv, kpm, true, float_mask, average);
    auto [y_ref, w_ref] = theirs(q, kv, kv, kpm, true, float_mask, average);
    expect_close(y, y_ref);
    expect_close(w, w_ref);
  }
  // SDPA path (no weights) gives the same output.
  auto [y_sdpa, none] = ours(q, kv, kv, kpm, /*need_weights=*/false, float_mask);
  expect_close(y_sdpa, std::get<0>(theirs(q, kv, kv, kpm, true, float_mask)));
  EXPECT_FALSE(none.defined());
}

TEST(MultiheadAttention, BatchFirstUnbatchedAndCausal) {
  torch::manual_seed(5);
  torchmha::MultiheadAttention seq_first(torchmha::MultiheadAttentionOptions(8, 2));
  torchmha::MultiheadAttention batch_first(torchmha::MultiheadAttentionOptions(8, 2).batch_first(true));
  seq_first->to(torch::kFloat64);
  batch_first->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : seq_first->named_parameters()) {
      batch_first->named_parameters()[p.key()].copy_(p.value());
    }
  }
  auto x = torch::randn({6, 3, 8}, f64());
  auto causal = torch::ones({6, 6}, torch::kBool).triu(1);
  auto expected = std::get<0>(seq_first->forward(x, x, x, {}, true, causal));
  auto xb = x.transpose(0, 1).contiguous();
  auto [yb, wb] = batch_first->forward(xb, xb, xb, {}, false, causal, true, /*is_causal=*/true);
  expect_close(yb.transpose(0, 1), expected);
  EXPECT_TRUE(yb.is_contiguous());
  // Unbatched (L, E) equals batch of one.
  auto x0 = x.select(1, 0);
  auto [y0, w0] = seq_first->forward(x0, x0, x0, {}, true, causal);
  expect_close(y0, expected.select(1, 0));
  EXPECT_EQ(w0.sizes(), torch::IntArrayRef({6, 6}));
  // is_causal needs attn_mask, as in torch.
  EXPECT_THROW(seq_first->forward(x, x, x, {}, false, {}, true, true), c10::Error);
}

TEST(MultiheadAttention, WorksInSequentialWithDefaultArguments) {
  torch::nn::Sequential seq(torchmha::MultiheadAttentionV2(8, 2), torch::nn::Linear(8, 4));
  auto y = seq->forward(torch::randn({5, 2, 8}));
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({5, 2, 4}));
  torch::nn::AnyModule any(torchmha::MultiheadAttention(8, 2));
  auto x = torch::randn({5, 2, 8});
  auto out = any.forward<std::tuple<Tensor, Tensor>>(x, x, x);
  EXPECT_EQ(std::get<0>(out).sizes(), x.sizes());
  EXPECT_EQ(std::get<1>(out).sizes(), torch::IntArrayRef({2, 5, 5}));
}

TEST(MultiheadAttention, SameInitialisationAsLibTorchLinearOrder) {
  // out_proj draws first, then xavier on in_proj_weight: reseeding gives identical modules.
  torch::manual_seed(7);
  torchmha::MultiheadAttention a(8, 2);
  torch::manual_seed(7);
  torchmha::MultiheadAttention b(8, 2);
  EXPECT_TRUE(torch::equal(a->in_proj_weight, b->in_proj_weight));
  EXPECT_TRUE(torch::equal(a->out_proj->weight, b->out_proj->weight));
  EXPECT_EQ(a->in_proj_bias.abs().sum().item<double>(), 0.0);
  const double bound = std::sqrt(6.0 / (8 + 24));  // xavier_uniform_ on (3E, E)
  EXPECT_LE(a->in_proj_weight.abs().max().item<double>(), bound);
}

// Forward from 8 threads on one module (eval: read-only) and forward+backward on separate clones
// give the serial results exactly; the ThreadSanitizer build (make test-sanitizers) checks for races.
TEST(Concurrency, ForwardAndBackwardFromEightThreads) {
  torch::manual_seed(8);
  torchmha::MultiheadAttention shared(torchmha::MultiheadAttentionOptions(16, 4).batch_first(true));
  shared->eval();
  constexpr int kThreads = 8;
  std::vector<Tensor> inputs, serial_out, serial_grad;
  std::vector<std::shared_ptr<torchmha::MultiheadAttentionImpl>> clones;
  for (int i = 0; i < kThreads; ++i) {
    inputs.push_back(torch::randn({2, 6, 16}));
    serial_out.push_back(std::get<0>(shared->forward(inputs[i], inputs[i], inputs[i])));
    clones.push_back(std::dynamic_pointer_cast<torchmha::MultiheadAttentionImpl>(shared->clone()));
    clones[i]->train();
  }
  auto grad_of = [&](torchmha::MultiheadAttentionImpl& module, const Tensor& x) {
    auto loss = std::get<0>(module.forward(x, x, x, {}, /*need_weights=*/false)).square().sum();
    return torch::autograd::grad({loss}, {module.in_proj_weight})[0];
  };
  for (int i = 0; i < kThreads; ++i) {
    serial_grad.push_back(grad_of(*clones[i], inputs[i]));
  }
  std::vector<Tensor> thread_out(kThreads), thread_grad(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int repeat = 0; repeat < 3; ++repeat) {
        thread_out[i] = std::get<0>(shared->forward(inputs[i], inputs[i], inputs[i]));
        thread_grad[i] = grad_of(*clones[i], inputs[i]);
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_TRUE(torch::equal(thread_out[i], serial_out[i])) << "thread " << i;
    EXPECT_TRUE(torch::equal(thread_grad[i], serial_grad[i])) << "thread " << i;
  }
}

}  // namespace
