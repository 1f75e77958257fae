#pragma once

// The attention of one decoding step over each sequence's own prefix of a key/value cache, with
// the step's keys and values written into the cache first. Its own op (torchmha::decode_attention)
// so that it has a kernel per device: a CPU kernel of torchmha's own (one pass over the cache per
// (sequence, head), at::vec and at::parallel_for) and the ATen composition below everywhere else
// (other devices, other dtypes, dropout, Meta for tracing).
//
// Shapes: N sequences, H heads, T new positions, D head size, M cache capacity.
//   q, k_new, v_new  (N, H, T, D)   the step's projections (strided views are fine)
//   k_cache, v_cache (N, H, M, D)   written at [lengths[n], lengths[n] + new_lengths[n])
//   lengths          (N,) int64     positions filled before the step; advanced by new_lengths
//   new_lengths      (N,) int64     positions this step appends per sequence (<= T); none: T each
//   padding          (N, S) additive key padding over cache positions [0, S), or none
// Query t of sequence n sees keys 0 .. lengths[n] + t. The result is (N, H, T, D), with zeros in
// the rows t >= new_lengths[n].

#include "common.h"

#include <optional>

namespace torchmha::core {

/// The longest filled prefix, max(lengths), in eager mode on every device, so that a step's cost
/// follows what is filled, not the capacity. On an accelerator that read is one device-to-host copy
/// of a number (a sync) a step: the ATen composition there launches tens of small kernels a step,
/// and over a large capacity it would read every cached row. Traced (fake and functional tensors
/// carry the Python or Functionalize key) or with TORCHMHA_DECODE_STATIC_SHAPES=1: nullopt, and
/// callers work on the whole capacity, a static shape on purpose: a compiled step is one graph for
/// every length, and a CUDA graph captured by hand (where a sync cannot be captured) replays for
/// every length.
std::optional<int64_t> filled_length(const Tensor& lengths);

/// Through the dispatcher (the op torchmha::decode_attention).
Tensor decode_attention(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths,
                        const OptionalTensor& padding, double dropout_p);

/// The ATen composition: the reference and the fallback (any device). In eager mode it reads only
/// the filled prefix; traced or with static shapes asked for, the whole capacity with a mask
/// (filled_length).
Tensor decode_attention_reference(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                                  const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths,
                                  const OptionalTensor& padding, double dropout_p);

/// torchmha's CPU kernel (float, double, and bfloat16/float16 computed in float; without dropout;
/// TORCHMHA_DECODE_KERNEL_MAX_ROWS limits the new rows it takes); the reference otherwise.
Tensor decode_attention_cpu(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                            const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths,
                            const OptionalTensor& padding, double dropout_p);

// ---------------------------------------------------------------- fixed keys
// The attention of a decoding step over fixed keys and values (a decoder's memory, projected once):
// every row of q sees every key. Its own op (torchmha::static_attention) for the same reason: the
// decode kernel's pass per (sequence, head) on the CPU, without the cache write; SDPA elsewhere.
//   q (N, H, T, D); keys, values (N, H, S, D); padding (N, S) additive, or none.
// A row whose keys are all masked gives zeros (as SDPA's CPU kernel).

/// Through the dispatcher (the op torchmha::static_attention).
Tensor static_attention(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding);

/// SDPA: the reference and the fallback (any device, Meta).
Tensor static_attention_reference(const Tensor& q, const Tensor& keys, const Tensor& values,
                                  const OptionalTensor& padding);

/// torchmha's CPU kernel where it takes the inputs (decode_attention's dtypes); the reference otherwise.
Tensor static_attention_cpu(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding);

}  // namespace torchmha::core
