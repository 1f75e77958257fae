#pragma once

// Attention that returns its weights: softmax(q k^T / sqrt(D) + mask) and those weights times v,
// with the weights averaged over the heads or per head. Its own op
// (torchmha::attention_with_weights) so that it has a kernel per device: torchmha's CPU kernel
// works through blocks of query rows, one head at a time, with the block's scores in a buffer the
// size of the block, so the (N, H, L, S) weights exist only where they are the result
// (average=false); everywhere else (other devices and dtypes, Meta for tracing) the ATen
// composition below. The op has no autograd formula and no dropout; for training the core wraps
// the CPU kernels and their backward in one autograd node (attention_with_weights_differentiable),
// and takes the composition where there is dropout or no kernel (attend.cpp).
//
// Shapes: q (N, H, L, D), k and v (N, H, S, D), strided views are fine; mask additive,
// broadcastable to (N, H, L, S). Result: heads (N, H, L, D) and weights (N, L, S) averaged, or
// (N, H, L, S).

#include "common.h"

#include <utility>

namespace torchmha::core {

/// Through the dispatcher (the op torchmha::attention_with_weights); the heads in (N, L, H, D)
/// memory with batch_major, else (L, N, H, D) (common/heads_layout.h).
std::pair<Tensor, Tensor> attention_with_weights(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const OptionalTensor& mask, bool average, bool batch_major = false);

/// The ATen composition, with dropout on the weights (torch's slow path, step for step): the
/// reference, and the path that autograd and dropout take.
std::pair<Tensor, Tensor> attention_with_weights_composition(const Tensor& q, const Tensor& k, const Tensor& v,
                                                             const OptionalTensor& mask, double dropout_p,
                                                             bool average);

/// The CPU kernels forward and backward as one autograd node (nothing of size (N, H, L, S) kept
/// for backward; double backward through the composition), where explicit_kernel_applies.
std::pair<Tensor, Tensor> attention_with_weights_differentiable(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                const OptionalTensor& mask, bool average);
/// The op's kernels: the composition without dropout (any device), and torchmha's CPU kernel
/// (float and double on AVX2/AVX-512 CPUs; the composition otherwise).
std::tuple<Tensor, Tensor> attention_with_weights_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                                            const OptionalTensor& mask, bool average,
                                                            bool batch_major);
std::tuple<Tensor, Tensor> attention_with_weights_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const OptionalTensor& mask, bool average, bool batch_major);

}  // namespace torchmha::core
