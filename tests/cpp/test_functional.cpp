// The functional API (functional.h) called directly.

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using torch::Tensor;

using torchmha_test::expect_close;
using torchmha_test::f64;

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

}  // namespace
