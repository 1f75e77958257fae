// Attention without its weights: the op's front, its ATen composition and the autograd node
// (blocked_attention.h); the CPU kernel is csrc/cpu/blocked_attention_kernel.cpp.

#include "blocked_attention.h"

#include "common/heads_layout.h"
#include "cpu/kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace torchmha::core {

std::tuple<Tensor, Tensor> blocked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const OptionalTensor& mask, bool is_causal, bool batch_major) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchmha::blocked_attention", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                         const OptionalTensor&, bool, bool)>();
  return op.call(q, k, v, mask, is_causal, batch_major);
}

namespace {

// q k^T / sqrt(D) + mask, with keys past the causal limit at -inf: (N, H, L, S).
Tensor masked_scores(const Tensor& q, const Tensor& k, const OptionalTensor& mask, bool is_causal) {
  const int64_t L = q.size(2), S = k.size(2);
  auto scores = at::matmul(q, k.transpose(2, 3)).mul_(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  if (is_present(mask)) {
    scores.add_(*mask);
  }
  if (is_causal) {
    scores.masked_fill_(at::ones({L, S}, q.options().dtype(at::kBool)).triu_(1),
                        -std::numeric_limits<double>::infinity());
  }
  return scores;
}

}  // namespace

std::tuple<Tensor, Tensor> blocked_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                                       const OptionalTensor& mask, bool is_causal, bool batch_major) {
  const Tensor scores = masked_scores(q, k, mask, is_causal).to(at::kFloat);
  Tensor lse = at::logsumexp(scores, -1);
  // A row with no allowed key: zeros (SDPA's), and +inf for its log-sum-exp (the kernel's).
  lse.masked_fill_(lse == -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity());
  const Tensor probabilities = at::exp(scores - lse.unsqueeze(-1)).to(q.scalar_type());
  return std::make_tuple(heads_laid_out(at::matmul(probabilities, v), batch_major), lse);
}

std::tuple<Tensor, Tensor, Tensor> blocked_attention_backward_reference(const Tensor& grad_heads, const Tensor& q,
                                                                       const Tensor& k, const Tensor& v,
                                                                       const OptionalTensor& mask, bool is_causal,
                                                                       const Tensor& heads, const Tensor& lse) {
  // P from the saved log-sum-exp (0 where it is +inf), then flash attention's backward.
  const auto f32 = [](const Tensor& t) { return t.to(at::kFloat); };
  const Tensor scores = masked_scores(f32(q), f32(k), is_present(mask) ? OptionalTensor(f32(*mask)) : mask, is_causal);
  const Tensor p = at::exp(scores - lse.unsqueeze(-1));
  const Tensor d_out = f32(grad_heads);
  const Tensor dp = at::matmul(d_out, f32(v).transpose(2, 3));
  const Tensor delta = (d_out * f32(heads)).sum(-1, /*keepdim=*/true);
  const Tensor ds = p * (dp - delta) / std::sqrt(static_cast<double>(q.size(3)));
  const auto dtype = q.scalar_type();
  return std::make_tuple(at::matmul(ds, f32(k)).to(dtype), at::matmul(ds.transpose(2, 3), f32(q)).to(dtype),
                         at::matmul(p.transpose(2, 3), d_out).to(dtype));
}

std::tuple<Tensor, Tensor, Tensor> blocked_attention_backward_meta(const Tensor& grad_heads, const Tensor& q,
                                                                  const Tensor& k, const Tensor& v,
                                                                  const OptionalTensor& mask, bool is_causal,
                                                                  const Tensor& heads, const Tensor& lse) {
  (void)grad_heads, (void)mask, (void)is_causal, (void)heads, (void)lse;
  const auto contiguous = at::MemoryFormat::Contiguous;
  return std::make_tuple(at::empty_like(q, contiguous), at::empty_like(k, contiguous), at::empty_like(v, contiguous));
}

std::tuple<Tensor, Tensor> blocked_attention_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const OptionalTensor& mask, bool is_causal, bool batch_major) {
  if (auto out = cpu::blocked_attention(q, k, v, mask, is_causal, batch_major)) {
    return *std::move(out);
  }
  return blocked_attention_reference(q, k, v, mask, is_causal, batch_major);
}

std::tuple<Tensor, Tensor, Tensor> blocked_attention_backward_cpu(const Tensor& grad_heads, const Tensor& q,
                                                                 const Tensor& k, const Tensor& v,
                                                                 const OptionalTensor& mask, bool is_causal,
                                                                 const Tensor& heads, const Tensor& lse) {
  if (auto grads = cpu::blocked_attention_backward(grad_heads, q, k, v, mask, is_causal, heads, lse)) {
    return *std::move(grads);
  }
  return blocked_attention_backward_reference(grad_heads, q, k, v, mask, is_causal, heads, lse);
}

// ------------------------------------------------------------------------------ autograd
namespace {

// The CPU kernels as one autograd node: the saved log-sum-exp replaces the (N, H, L, S)
// probabilities. Under create_graph (double backward) the backward differentiates SDPA's math
// instead, so higher derivatives work as in torch.
struct BlockedAttentionFunction : public torch::autograd::Function<BlockedAttentionFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                                                bool is_causal) {
    auto [heads, lse] = blocked_attention(q, k, v, mask, is_causal);
    ctx->save_for_backward({q, k, v, heads, lse});
    ctx->saved_data["mask"] = mask;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->mark_non_differentiable({lse});
    return {heads, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &heads = saved[3], &lse = saved[4];
    const OptionalTensor mask = ctx->saved_data["mask"].toOptional<Tensor>();
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    if (at::GradMode::is_enabled()) {
      auto out = at::_scaled_dot_product_attention_math(q, k, v, mask, 0.0, is_causal);
      const auto g = torch::autograd::grad({std::get<0>(out)}, {q, k, v}, {grads[0]}, /*retain_graph=*/true,
                                           /*create_graph=*/true, /*allow_unused=*/true);
      return {g[0], g[1], g[2], Tensor(), Tensor()};
    }
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchmha::blocked_attention_backward", "")
                         .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                   const Tensor&, const OptionalTensor&, bool,
                                                                   const Tensor&, const Tensor&)>();
    auto [dq, dk, dv] = op.call(grads[0], q, k, v, mask, is_causal, heads, lse);
    return {dq, dk, dv, Tensor(), Tensor()};
  }
};

}  // namespace

Tensor blocked_attention_differentiable(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                                        bool is_causal) {
  return BlockedAttentionFunction::apply(q, k, v, mask, is_causal)[0];
}

}  // namespace torchmha::core
