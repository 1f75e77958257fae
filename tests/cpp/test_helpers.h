#pragma once

// Helpers shared by the GoogleTest files: float64 options and the project's 1e-10 comparison.

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

}  // namespace torchmha_test
