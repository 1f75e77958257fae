// TransformerBlock (transformer_block.h).

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;

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
