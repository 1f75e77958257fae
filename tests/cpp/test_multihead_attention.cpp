// torchmha::MultiheadAttention (multihead_attention.h): parameter names, parity with LibTorch's
// module, batch_first/unbatched/causal, Sequential, initialisation, threads, and its cache methods
// (forward_with_cache with a KeyValueCache or a StaticKeyValue, project_key_value).

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;
using torchmha_test::causal_mask;
using torchmha_test::float64_attention;
using torchmha_test::libtorch_copy;

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

// With weights and no dropout the attention runs torchmha's explicit-weights kernels (blocks of
// query rows, no per-head scores tensor): under NoGradGuard the forward kernel alone, in training
// with its backward kernel as one autograd node. LibTorch's numbers and gradients both.
TEST(MultiheadAttention, WeightsKernelsMatchLibTorchForwardAndBackward) {
  torch::manual_seed(5);
  auto ours = float64_attention(torchmha::MultiheadAttentionOptions(16, 4));
  auto theirs = libtorch_copy(ours);
  // 600 x 240 scores a head: above the size from which the core uses the kernels.
  auto q = torch::randn({600, 2, 16}, f64());
  auto kv = torch::randn({240, 2, 16}, f64());
  auto kpm = torch::rand({2, 240}) < 0.3;
  kpm.select(1, 0).fill_(false);
  auto mask = torch::randn({600, 240}, f64());
  for (bool average : {true, false}) {
    auto [y_ref, w_ref] = theirs(q, kv, kv, kpm, true, mask, average);
    torch::NoGradGuard no_grad;
    auto [y, w] = ours(q, kv, kv, kpm, true, mask, average);
    expect_close(y, y_ref);
    expect_close(w, w_ref);
  }
  for (bool average : {true, false}) {
    std::vector<Tensor> grads[2];
    for (int which = 0; which < 2; ++which) {
      auto q_leaf = q.clone().requires_grad_(), kv_leaf = kv.clone().requires_grad_();
      auto [y, w] = which == 0 ? theirs(q_leaf, kv_leaf, kv_leaf, kpm, true, mask, average)
                               : ours(q_leaf, kv_leaf, kv_leaf, kpm, true, mask, average);
      ((y * y).sum() + (w * w).sum()).backward();
      grads[which] = {q_leaf.grad(), kv_leaf.grad()};
    }
    expect_close(grads[1][0], grads[0][0]);
    expect_close(grads[1][1], grads[0][1]);
  }
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
  // torch's layout: batch_first output is the transposed view of an (L, N, E) tensor.
  EXPECT_TRUE(yb.transpose(0, 1).is_contiguous());
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

class DecodingChunks : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(DecodingChunks, EqualsFullCausalForward) {
  const auto [chunk, padded] = GetParam();
  torch::manual_seed(0);
  const int64_t E = 16, H = 4, N = 2, L = 9;
  auto mha = float64_attention(torchmha::MultiheadAttentionOptions(E, H));
  auto x = torch::randn({L, N, E}, f64());
  Tensor kpm;
  if (padded) {
    kpm = torch::rand({N, L}) < 0.3;
    kpm.select(1, 0).fill_(false);  // key 0 stays visible: no query is fully masked
  }
  auto expected = std::get<0>(mha->forward(x, x, x, kpm, /*need_weights=*/false, causal_mask(L)));

  auto cache = torchmha::KeyValueCache::for_module(*mha, N, L);
  torch::NoGradGuard no_grad;
  std::vector<Tensor> steps;
  for (int64_t start = 0; start < L; start += chunk) {
    const int64_t stop = std::min(start + chunk, L);
    auto step_kpm = padded ? kpm.narrow(1, 0, stop) : Tensor();
    steps.push_back(mha->forward_with_cache(x.narrow(0, start, stop - start), cache, step_kpm));
  }
  EXPECT_EQ(cache.length(), L);
  expect_close(torch::cat(steps, 0), expected);
}

INSTANTIATE_TEST_SUITE_P(
    ChunkSizes,
    DecodingChunks,
    ::testing::Combine(::testing::Values(1, 2, 4, 9), ::testing::Bool()));

TEST(StaticKeyValue, MemoryProjectedOnceEqualsCrossAttention) {
  torch::manual_seed(2);
  auto mha = float64_attention(torchmha::MultiheadAttentionOptions(12, 3).kdim(5).vdim(7));
  auto query = torch::randn({4, 2, 12}, f64());
  auto key = torch::randn({6, 2, 5}, f64());
  auto value = torch::randn({6, 2, 7}, f64());
  auto memory = mha->project_key_value(key, value);
  EXPECT_EQ(memory.keys.sizes(), torch::IntArrayRef({2, 3, 6, 4}));
  auto expected = std::get<0>(mha->forward(query, key, value, {}, false));
  expect_close(mha->forward_with_cache(query, memory), expected);
}

}  // namespace
