#pragma once

// Helpers shared by the GoogleTest files: float64 options, the project's 1e-10 comparison, and
// modules built the way several tests need them.

#include <torchmha/torchmha.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace torchmha_test {

constexpr double kTol64 = 1e-10;

inline torch::TensorOptions f64() {
  return torch::TensorOptions().dtype(torch::kFloat64);
}

inline void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double tol = kTol64) {
  ASSERT_EQ(actual.sizes(), expected.sizes());
  const double diff = (actual - expected).abs().max().item<double>();
  EXPECT_LE(diff, tol) << "max abs difference " << diff;
}

/// (length, length) bool mask, true above the diagonal (not allowed), as torch's causal masks.
inline torch::Tensor causal_mask(int64_t length) {
  return torch::ones({length, length}, torch::kBool).triu(1);
}

/// A float64 module in eval mode with non-zero biases, so a dropped bias shows.
inline torchmha::MultiheadAttention float64_attention(torchmha::MultiheadAttentionOptions options) {
  torchmha::MultiheadAttention mha(options);
  mha->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  mha->in_proj_bias.normal_();
  mha->out_proj->bias.normal_();
  mha->eval();
  return mha;
}

/// LibTorch's own module with the same weights as a torchmha one (packed, bias, no extras).
inline torch::nn::MultiheadAttention libtorch_copy(torchmha::MultiheadAttention& ours) {
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

}  // namespace torchmha_test
