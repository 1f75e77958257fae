// KeyValueCache (kv_cache.h): life cycle, errors that leave it unchanged.

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;
using torchmha_test::causal_mask;
using torchmha_test::float64_attention;

TEST(KeyValueCache, BatchFirstResetAndReuse) {
  torch::manual_seed(1);
  const int64_t E = 8, H = 2, L = 6;
  auto mha = float64_attention(torchmha::MultiheadAttentionOptions(E, H).batch_first(true));
  auto cache = torchmha::KeyValueCache::for_module(*mha, 3, L);
  EXPECT_EQ(cache.keys().sizes(), torch::IntArrayRef({3, H, L, E / H}));
  torch::NoGradGuard no_grad;
  for (int64_t batch : {3, 3, 1}) {
    cache.reset(batch);
    auto x = torch::randn({batch, L, E}, f64());
    auto expected = std::get<0>(mha->forward(x, x, x, {}, false, causal_mask(L)));
    std::vector<Tensor> steps;
    for (int64_t t = 0; t < L; ++t) {
      steps.push_back(mha->forward_with_cache(x.narrow(1, t, 1), cache));
    }
    expect_close(torch::cat(steps, 1), expected);
  }
  EXPECT_EQ(cache.batch_size(), 1);
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
}

TEST(KeyValueCache, FullOrWrongBatchThrowsAndKeepsLength) {
  auto mha = float64_attention(torchmha::MultiheadAttentionOptions(8, 2));
  auto cache = torchmha::KeyValueCache::for_module(*mha, 2, 3);
  torch::NoGradGuard no_grad;
  mha->forward_with_cache(torch::randn({2, 2, 8}, f64()), cache);
  try {
    mha->forward_with_cache(torch::randn({2, 2, 8}, f64()), cache);
    FAIL() << "expected a full-cache error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache is full"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length(), 2);
  EXPECT_THROW(mha->forward_with_cache(torch::randn({1, 5, 8}, f64()), cache), torchmha::ArgumentError);
  EXPECT_EQ(cache.length(), 2);
  EXPECT_THROW(torchmha::KeyValueCache(1, 0, 4, 4), c10::ValueError);
  torchmha::MultiheadAttention with_bias_kv(torchmha::MultiheadAttentionOptions(8, 2).add_bias_kv(true));
  auto other = torchmha::KeyValueCache::for_module(*with_bias_kv, 1, 2);
  EXPECT_THROW(with_bias_kv->forward_with_cache(torch::randn({1, 1, 8}), other), c10::Error);
}

TEST(KeyValueCache, OtherHeadSplitOrKdimIsRejected) {
  // 2 heads of 4 in the module; 4 heads of 2 hold the same 8 features, which the ops alone accept.
  auto mha = float64_attention(torchmha::MultiheadAttentionOptions(8, 2));
  torch::NoGradGuard no_grad;
  auto x = torch::randn({1, 1, 8}, f64());
  torchmha::KeyValueCache four_heads(1, 4, 3, 2, f64());
  try {
    mha->forward_with_cache(x, four_heads);
    FAIL() << "expected a head-split error";
  } catch (const torchmha::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("the module has 2 heads of size 4"), std::string::npos) << e.what();
  }
  EXPECT_EQ(four_heads.length(), 0);
  auto split_other_way = torch::randn({1, 4, 3, 2}, f64());
  EXPECT_THROW(
      mha->forward_with_cache(x, torchmha::StaticKeyValue{split_other_way, split_other_way}), torchmha::ArgumentError);
  auto cross = float64_attention(torchmha::MultiheadAttentionOptions(8, 2).kdim(5).vdim(5));
  auto cache = torchmha::KeyValueCache::for_module(*cross, 1, 3);
  try {
    cross->forward_with_cache(x, cache);
    FAIL() << "expected a kdim error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs kdim == vdim == embed_dim (8), but kdim is 5"), std::string::npos)
        << e.what();
  }
}

// Each sequence's last `count` outputs of torch-style causal attention over that sequence alone.
Tensor alone(torchmha::MultiheadAttention& mha, const Tensor& tokens, int64_t count) {
  const auto x = tokens.unsqueeze(1);  // (L, 1, E)
  auto out = std::get<0>(mha->forward(x, x, x, {}, false, causal_mask(x.size(0)))).squeeze(1);
  return out.narrow(0, out.size(0) - count, count);
}

TEST(KeyValueCache, SequencesAtDifferentPositionsReorderAndReset) {
  torch::manual_seed(2);
  const int64_t E = 8, H = 2, N = 3;
  auto mha = float64_attention(torchmha::MultiheadAttentionOptions(E, H));
  auto cache = torchmha::KeyValueCache::for_module(*mha, N, 12);
  torch::NoGradGuard no_grad;
  std::vector<Tensor> tokens(N, torch::empty({0, E}, f64()));
  auto step = [&](const Tensor& x, std::vector<int64_t> counts) {
    auto out = mha->forward_with_cache(x, cache, {}, torch::tensor(counts));
    for (int64_t i = 0; i < N; ++i) {
      tokens[i] = torch::cat({tokens[i], x.narrow(0, 0, counts[i]).select(1, i)});
      if (counts[i] > 0) {
        expect_close(out.narrow(0, 0, counts[i]).select(1, i), alone(mha, tokens[i], counts[i]));
      }
      EXPECT_FALSE(out.narrow(0, counts[i], x.size(0) - counts[i]).select(1, i).any().item<bool>());
      EXPECT_EQ(cache.lengths()[i].item<int64_t>(), tokens[i].size(0));
    }
  };
  step(torch::randn({4, N, E}, f64()), {2, 4, 1});  // prefill of mixed lengths
  step(torch::randn({1, N, E}, f64()), {1, 1, 1});
  EXPECT_THROW(cache.length(), c10::Error);
  cache.reorder(torch::tensor({1, 1, 0}));  // beam search
  tokens = {tokens[1], tokens[1], tokens[0]};
  step(torch::randn({1, N, E}, f64()), {1, 1, 1});
  cache.reset(torch::tensor({2}));  // a new sequence in slot 2
  tokens[2] = torch::empty({0, E}, f64());
  step(torch::randn({7, N, E}, f64()), {1, 1, 7});
  EXPECT_EQ(cache.length(), 7);
}

}  // namespace
