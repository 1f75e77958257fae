// Attention that returns its weights (explicit_attention.h).

#include "explicit_attention.h"

#include "common/heads_layout.h"
#include "cpu/kernels.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace torchmha::core {

std::pair<Tensor, Tensor> attention_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const OptionalTensor& mask, bool average, bool batch_major) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchmha::attention_with_weights", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                         const OptionalTensor&, bool, bool)>();
  auto [heads, weights] = op.call(q, k, v, mask, average, batch_major);
  return {heads, weights};
}

std::pair<Tensor, Tensor> attention_with_weights_composition(const Tensor& q, const Tensor& k, const Tensor& v,
                                                             const OptionalTensor& mask, double dropout_p,
                                                             bool average) {
  // bmm over the N*H heads (reshape copies strided heads once; 4-D matmul would add more ops).
  // The 1/sqrt(D) scale is the GEMM's alpha rather than a pass over q (torch scales q; the two
  // agree to rounding, exactly when D is a power of 4). beta = 0 ignores the input, so a
  // zero-stride placeholder serves.
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto ignored_input = at::empty({1, 1, 1}, q.options()).expand({N * H, L, S});
  auto scores = at::baddbmm(ignored_input, q.reshape({N * H, L, D}), k.reshape({N * H, S, D}).transpose(1, 2),
                            /*beta=*/0, /*alpha=*/scale)
                    .view({N, H, L, S});
  // In place on the GEMM's fresh output (its backward reads only its inputs): spares an
  // N*H*L*S allocation.
  if (is_present(mask)) {
    scores.add_(*mask);
  }
  auto weights = at::softmax(scores, -1);
  if (dropout_p > 0.0) {
    weights = at::dropout(weights, dropout_p, /*train=*/true);
  }
  auto output = at::bmm(weights.reshape({N * H, L, S}), v.reshape({N * H, S, D})).view({N, H, L, D});
  return {output, average ? weights.mean(1) : weights};
}

std::tuple<Tensor, Tensor> attention_with_weights_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                                            const OptionalTensor& mask, bool average,
                                                            bool batch_major) {
  auto [heads, weights] = attention_with_weights_composition(q, k, v, mask, /*dropout_p=*/0.0, average);
  // The CPU kernel's layout (fake tensors must match it): the copy the output projection would
  // make anyway.
  return std::make_tuple(heads_laid_out(heads, batch_major), weights);
}
std::tuple<Tensor, Tensor> attention_with_weights_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const OptionalTensor& mask, bool average, bool batch_major) {
  if (auto out = cpu::attention_with_weights(q, k, v, mask, average, batch_major)) {
    return *std::move(out);
  }
  return attention_with_weights_reference(q, k, v, mask, average, batch_major);
}

// ------------------------------------------------------------------------------ autograd
namespace {

// The CPU kernels as one autograd node: nothing of size (N, H, L, S) is kept for backward, which
// recomputes the probabilities block by block. Under create_graph (double backward) the
// backward differentiates the composition instead, so higher derivatives work as in torch.
struct ExplicitAttentionFunction : public torch::autograd::Function<ExplicitAttentionFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                                                bool average) {
    // (the mask needs no gradient here: attend.cpp sends one that does to the composition)
    ctx->save_for_backward({q, k, v});
    // An unused output's gradient stays undefined rather than zeros: with fully masked (NaN) rows,
    // 0 * NaN would reach dV where torch computes nothing.
    ctx->set_materialize_grads(false);
    ctx->saved_data["mask"] = mask;
    ctx->saved_data["average"] = average;
    auto [heads, weights] = attention_with_weights(q, k, v, mask, average);
    return {heads, weights};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const OptionalTensor mask = ctx->saved_data["mask"].toOptional<Tensor>();
    const bool average = ctx->saved_data["average"].toBool();
    Tensor dq, dk, dv;
    if (at::GradMode::is_enabled()) {
      std::tie(dq, dk, dv) = composition_backward(q, k, v, mask, average, grads);
    } else {
      std::tie(dq, dk, dv) = cpu::attention_with_weights_backward(q, k, v, mask, average, grads[0], grads[1]);
    }
    return {dq, dk, dv, Tensor(), Tensor()};
  }

  // The gradients through the differentiable composition, with a graph of their own.
  static std::tuple<Tensor, Tensor, Tensor> composition_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                 const OptionalTensor& mask, bool average,
                                                                 const torch::autograd::variable_list& grads) {
    auto [heads, weights] = attention_with_weights_composition(q, k, v, mask, /*dropout_p=*/0.0, average);
    torch::autograd::variable_list outputs, grad_outputs;
    for (const auto& [output, grad] : {std::pair{heads, grads[0]}, std::pair{weights, grads[1]}}) {
      if (grad.defined()) {
        outputs.push_back(output);
        grad_outputs.push_back(grad);
      }
    }
    if (outputs.empty()) {
      return {Tensor(), Tensor(), Tensor()};
    }
    const auto g = torch::autograd::grad(outputs, {q, k, v}, grad_outputs, /*retain_graph=*/true,
                                         /*create_graph=*/true, /*allow_unused=*/true);
    return {g[0], g[1], g[2]};
  }
};

}  // namespace

std::pair<Tensor, Tensor> attention_with_weights_differentiable(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                const OptionalTensor& mask, bool average) {
  const auto outputs = ExplicitAttentionFunction::apply(q, k, v, mask, average);
  return {outputs[0], outputs[1]};
}

}  // namespace torchmha::core
