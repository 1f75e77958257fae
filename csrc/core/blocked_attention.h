#pragma once

// Attention without its weights, softmax(q k^T / sqrt(D) + mask) v, by torchmha's blocked CPU
// kernel: flash attention's running softmax over blocks of keys, per block of query rows, so no
// L x S scores exist beyond one block's. Its own op (torchmha::blocked_attention) so that it has a
// kernel per device: the CPU kernel for float32 (bfloat16 and float16 computed in float32), the
// ATen composition everywhere else (other devices, Meta for tracing). The core takes it where it
// beats SDPA on the running machine (blocked_kernel_pays_off, measured) and SDPA everywhere else;
// for training, the kernel and its block-wise backward as one autograd node.
//
// Shapes: q (N, H, L, D), k and v (N, H, S, D), rows contiguous along D; mask additive of q's
// dtype, broadcastable to (N, H, L, S); `is_causal`: key s only for query rows l >= s (SDPA's,
// top-left). Results: the heads (N, H, L, D), a view of (L, N, H, D) memory, or (N, L, H, D) with
// batch_major (the output projection's order, common/heads_layout.h), and the rows' log-sum-exp
// (N, H, L) in float32 (+inf where a row has no allowed key; its heads are zeros, as SDPA's).

#include "common.h"

#include <tuple>

namespace torchmha::core {

/// Through the dispatcher (the op torchmha::blocked_attention): {heads, log-sum-exp}.
std::tuple<Tensor, Tensor> blocked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const OptionalTensor& mask, bool is_causal, bool batch_major = false);

/// The kernels forward and backward as one autograd node (double backward through SDPA's math):
/// the heads (N, H, L, D).
Tensor blocked_attention_differentiable(const Tensor& q, const Tensor& k, const Tensor& v, const OptionalTensor& mask,
                                        bool is_causal);

/// The op's kernels: the ATen composition (any device), and on the CPU torchmha's kernel
/// (csrc/cpu/kernels.h), the composition where it does not take the inputs.
std::tuple<Tensor, Tensor> blocked_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                                       const OptionalTensor& mask, bool is_causal, bool batch_major);
std::tuple<Tensor, Tensor> blocked_attention_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const OptionalTensor& mask, bool is_causal, bool batch_major);

/// Its backward (op torchmha::blocked_attention_backward): {dq, dk, dv} from the heads' gradient and
/// the forward's results, the probabilities recomputed block by block from the log-sum-exp. The
/// composition (any device) and the CPU kernel.
std::tuple<Tensor, Tensor, Tensor> blocked_attention_backward_reference(const Tensor& grad_heads, const Tensor& q,
                                                                       const Tensor& k, const Tensor& v,
                                                                       const OptionalTensor& mask, bool is_causal,
                                                                       const Tensor& heads, const Tensor& lse);
/// Its shapes only, for fake tensors (Meta): the composition's bfloat16 conversions hit an internal
/// assert of torch's fake-tensor dispatch (opcheck's aot_dispatch).
std::tuple<Tensor, Tensor, Tensor> blocked_attention_backward_meta(const Tensor& grad_heads, const Tensor& q,
                                                                  const Tensor& k, const Tensor& v,
                                                                  const OptionalTensor& mask, bool is_causal,
                                                                  const Tensor& heads, const Tensor& lse);
std::tuple<Tensor, Tensor, Tensor> blocked_attention_backward_cpu(const Tensor& grad_heads, const Tensor& q,
                                                                 const Tensor& k, const Tensor& v,
                                                                 const OptionalTensor& mask, bool is_causal,
                                                                 const Tensor& heads, const Tensor& lse);

}  // namespace torchmha::core
