#pragma once

// The in-projection step: query, key and value through a module's q/k/v weights into heads.

#include "common.h"

#include <array>
#include <vector>

namespace torchmha::core {

/// A module's in-projection in either of torch's forms: the packed `packed_weight` (3 * inner,
/// E) (torch's in_proj_weight, rows q, k, v), or separate weights (inner, Eq), (inner, Ek),
/// (inner, Ev) (q/k/v_proj_weight, or the Linear layers of v1-v3 and CrossAttention). Biases:
/// packed (3 * inner) with either form of weight (torch's in_proj_bias), or separate (inner) each.
/// inner = num_heads * head_dim; for torch's modules it is embed_dim.
struct InProjection {
  OptionalTensor packed_weight, packed_bias;
  std::array<OptionalTensor, 3> weights;  // q, k, v (separate form)
  std::array<OptionalTensor, 3> biases;   // q, k, v (separate form)
  OptionalTensor packed_weight_scale = {};  // with an int8 packed weight (small_linear.h)

  bool packed() const { return is_present(packed_weight); }
  /// Rows of each projection's output (inner), read off the first weight present.
  int64_t inner() const;
};

/// Which inputs are one tensor, decided by identity (never by value), as torch's
/// _in_projection_packed decides: then one GEMM projects them together.
enum class Sharing { kSelfAttention, kSharedKeyValue, kSeparate };
Sharing sharing_of(const Tensor& query, const Tensor& key, const Tensor& value);

/// Shapes of the weights and biases against the inputs' feature sizes (q_features etc.); -1
/// skips an input that is not projected. Throws naming the argument and both shapes.
void check_in_projection(
    const InProjection& w,
    int64_t inner,
    int64_t q_features,
    int64_t k_features,
    int64_t v_features);

/// The GEMMs of the in-projection: each ProjectionGroup holds `parts` consecutive projections of
/// one input (q|k|v for self-attention, k|v for encoder-decoder with the packed weight; else one
/// each). Undefined inputs are not projected. `first_part` is 0 for q, 1 for k, 2 for v. Inputs
/// are (N, len, E) with batch_first, else (len, N, E).
struct ProjectionGroup {
  int first_part;
  int parts;
  Tensor output;
};
std::vector<ProjectionGroup> project(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const InProjection& w,
    Sharing sharing,
    bool batch_first);

/// project(), split into heads (N, H, len, inner / H) each, as strided views of the GEMM outputs.
/// Entries for inputs that were not projected stay undefined.
std::array<Tensor, 3> project_to_heads(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const InProjection& w,
    Sharing sharing,
    int64_t num_heads,
    bool batch_first);

/// (len, N, parts * H * D) or, with batch_first, (N, len, parts * H * D) -> `parts` tensors
/// (N, H, len, D), as strided views (no copy).
std::vector<Tensor> to_heads(const Tensor& x, int64_t parts, int64_t num_heads, bool batch_first);

/// (N, H, L, D) -> (L, N, H * D), contiguous.
Tensor merge_heads(const Tensor& x);

}  // namespace torchmha::core
