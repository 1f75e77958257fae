#pragma once

// The validate step: every check of the inputs, each written once with one message. Exception
// types follow torch.nn.MultiheadAttention: ValueError for sizes, ArgumentError (Python's
// AssertionError) for ranks and shapes, RuntimeError where torch fails inside an op.

#include "arguments.h"

#include <torchmha/export.h>

#include <c10/core/SymInt.h>

namespace torchmha::core {

void check_positive_sizes(int64_t embed_dim, int64_t num_heads);
void check_divisible(int64_t embed_dim, int64_t num_heads);
/// Both, and positive kdim and vdim (-1: not given), as module constructors check them.
/// (Exported for torchmha._C, whose Python classes check their sizes here too.)
TORCHMHA_API void check_module_sizes(int64_t embed_dim, int64_t num_heads, int64_t kdim = -1, int64_t vdim = -1);
void check_dropout(double p);

/// Masks are bool (true = not allowed) or floating point (added to the scores).
void check_mask_kind(const OptionalTensor& mask, const char* name);

/// Sizes of a forward call, once its inputs are checked.
struct Geometry {
  bool batched;
  int64_t batch, tgt_len, src_len, head_dim;
};

/// Everything about a forward call that can be checked before the in-projection, in torch's
/// order, so a call with several faults raises what torch raises (the masks' kinds are checked
/// before, as torch's module forward does before its fast path).
Geometry validate_forward(const ForwardCall& call, const AttentionWeights& weights, int64_t embed_dim);

/// Mask shapes and the bias_k/bias_v pair, checked after the in-projection as torch does. The
/// attn_mask is only checked where it is read (`attn_mask_is_read`).
void check_mask_shapes(
    const ForwardCall& call,
    const AttentionWeights& weights,
    const Geometry& g,
    bool attn_mask_is_read);

/// torch's deprecation warning for masks of different dtypes, for the C++ modules (Python's
/// classes raise it through the warnings module, which a warning from inside an op does not reach).
void warn_if_mask_dtypes_differ(const OptionalTensor& key_padding_mask, const OptionalTensor& attn_mask);

/// key_padding_mask (N, S), or (S) for unbatched input, its rank already checked; torch names the
/// lengths with the `extra_positions` (bias_k, add_zero_attn) appended.
void check_padding_mask_shape(
    const Tensor& mask,
    int64_t batch,
    const c10::SymInt& src_len,
    bool batched,
    int64_t extra_positions = 0);

/// A float mask (the masks combined, bool ones made float) must have the query's dtype, as
/// baddbmm and SDPA require: it is added in that dtype, never promoted.
void check_mask_dtype(const OptionalTensor& mask, at::ScalarType query_dtype);

/// key and value: sequence and batch sizes agree (separate weights), or equal shapes (packed).
void check_key_value_shapes(const Tensor& key, const Tensor& value, bool separate_weights, bool batch_first);

// ---- decoding

/// `x` is batched 3-D, as the cached paths need.
void check_batched(const Tensor& x, const char* name, const char* function);
/// Cached paths hold no positions for bias_k/bias_v or add_zero_attn.
void check_no_extra_key_positions(const AttentionWeights& weights, const char* method);
/// Keys (N, H, S, D) split into the module's heads: another split passes every size check of
/// the ops (only H * D must match) and silently attends with the wrong heads.
void check_heads(const Tensor& keys, int64_t num_heads, int64_t head_dim, const char* what);
/// Keys and values of one shape (N, H, S, D) with the query's batch size; `hint` ends the message.
void check_keys_values(
    const Tensor& query,
    const Tensor& keys,
    const Tensor& values,
    bool batch_first,
    const char* function,
    const char* keys_name,
    const char* values_name,
    const char* hint);

}  // namespace torchmha::core
