// GoogleTest suite for decoding.h: key/value cache decoding equals one causal forward, cache
// life cycle and errors, the cross-attention cache, CrossAttention and TransformerBlock.

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;

Tensor causal_mask(int64_t length) {
  return torch::ones({length, length}, torch::kBool).triu(1);
}

torchmha::MultiheadAttention float64_attention(torchmha::MultiheadAttentionOptions options) {
  torchmha::MultiheadAttention mha(options);
  mha->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  mha->in_proj_bias.normal_();  // non-zero biases, so a dropped one shows
  mha->out_proj->bias.normal_();
  mha->eval();
  return mha;
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

TEST(TransformerBlock, PostAndPreNormWithGradients) {
  torch::manual_seed(4);
  for (bool norm_first : {false, true}) {
    torchmha::TransformerBlock block(torchmha::TransformerBlockOptions(8, 2).forward_expansion(3).norm_first(norm_first));
    block->to(torch::kFloat64);
    block->eval();
    std::vector<std::string> names;
    for (const auto& p : block->named_parameters()) {
      names.push_back(p.key());
    }
    const std::vector<std::string> expected_names = {
        "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias",
        "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
        "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"};
    EXPECT_EQ(names, expected_names);

    auto x = torch::randn({2, 5, 8}, f64());
    auto attend = [&](const Tensor& y) { return std::get<0>(block->self_attn->forward(y, y, y, {}, false)); };
    auto ffn = [&](const Tensor& y) { return block->linear2(torch::relu(block->linear1(y))); };
    Tensor expected;
    if (norm_first) {
      auto h = x + attend(block->norm1(x));
      expected = h + ffn(block->norm2(h));
    } else {
      auto h = block->norm1(x + attend(x));
      expected = block->norm2(h + ffn(h));
    }
    expect_close(block(x), expected);

    block->train();
    block(x.requires_grad_()).sum().backward();
    EXPECT_TRUE(block->linear1->weight.grad().defined());
    EXPECT_TRUE(block->self_attn->in_proj_weight.grad().defined());
  }
}

}  // namespace
