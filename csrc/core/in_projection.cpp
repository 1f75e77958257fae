// The in-projection step (in_projection.h).

#include "in_projection.h"

#include "small_linear.h"

#include <torchmha/errors.h>

#include <ATen/ops/linear.h>

namespace torchmha::core {
namespace {

const char* const kWeightNames[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
const char* const kPartNames[3] = {"query", "key", "value"};

// Rows [first * inner, (first + parts) * inner) of the packed weight or bias (all of them: the
// tensor itself, as a narrow costs a dispatch and a view).
OptionalTensor packed_rows(const OptionalTensor& packed, int first, int parts, int64_t inner) {
  if (!is_present(packed) || (first == 0 && parts * inner == packed->size(0))) {
    return packed;
  }
  return packed->narrow(0, first * inner, parts * inner);
}

OptionalTensor bias_of(const InProjection& w, int first, int parts, int64_t inner) {
  return is_present(w.packed_bias) ? packed_rows(w.packed_bias, first, parts, inner) : w.biases[first];
}

// The groups of parts that one GEMM projects: torch's three cases for the packed weight, one
// part per GEMM for separate weights.
std::vector<std::pair<int, int>> gemm_groups(bool packed, Sharing sharing) {
  if (packed && sharing == Sharing::kSelfAttention) {
    return {{0, 3}};
  }
  if (packed && sharing == Sharing::kSharedKeyValue) {
    return {{0, 1}, {1, 2}};
  }
  return {{0, 1}, {1, 1}, {2, 1}};
}

}  // namespace

int64_t InProjection::inner() const {
  if (packed()) {
    TORCH_CHECK(
        packed_weight->dim() == 2 && packed_weight->size(0) % 3 == 0,
        "in_proj_weight must have shape (3 * embed_dim, embed_dim), but got ", packed_weight->sizes());
    return packed_weight->size(0) / 3;
  }
  for (const auto& w : weights) {
    if (is_present(w)) {
      return w->size(0);
    }
  }
  TORCHMHA_CHECK_ARG(false, "in_proj_weight or q_proj_weight, k_proj_weight and v_proj_weight are needed");
  return 0;
}

Sharing sharing_of(const Tensor& query, const Tensor& key, const Tensor& value) {
  if (key.is_same(value)) {
    return query.is_same(key) ? Sharing::kSelfAttention : Sharing::kSharedKeyValue;
  }
  return Sharing::kSeparate;
}

void check_in_projection(
    const InProjection& w,
    int64_t inner,
    int64_t q_features,
    int64_t k_features,
    int64_t v_features) {
  if (w.packed()) {
    // A malformed packed weight fails inside torch's GEMM (RuntimeError); so does ours.
    // One packed weight projects inputs of one size: the first that is projected.
    const int64_t features = q_features >= 0 ? q_features : k_features;
    const auto& p = *w.packed_weight;
    TORCH_CHECK(
        p.dim() == 2 && p.size(0) == 3 * inner && p.size(1) == features,
        "in_proj_weight must have shape (3 * embed_dim, embed_dim) = (", 3 * inner, ", ", features,
        ") for inputs of embedding size ", features, ", but got ", p.sizes());
    if (is_present(w.packed_bias)) {
      TORCH_CHECK(
          w.packed_bias->dim() == 1 && w.packed_bias->size(0) == 3 * inner,
          "in_proj_bias must have shape (3 * embed_dim,) = (", 3 * inner, ",), but got ", w.packed_bias->sizes());
    }
    return;
  }
  // torch's _in_projection: the three weights, then the three biases (thirds of a packed bias).
  const int64_t features[3] = {q_features, k_features, v_features};
  for (int part = 0; part < 3; ++part) {
    if (features[part] < 0) {
      continue;
    }
    TORCHMHA_CHECK_ARG(is_present(w.weights[part]), "use_separate_proj_weight is True but ", kWeightNames[part],
                       " is None");
    const auto& weight = *w.weights[part];
    TORCHMHA_CHECK_ARG(
        weight.dim() == 2 && weight.size(0) == inner && weight.size(1) == features[part], "expecting ",
        kPartNames[part], " weights shape of (", inner, ", ", features[part], "), but got ", torch_size(weight.sizes()));
  }
  for (int part = 0; part < 3; ++part) {
    const auto bias = is_present(w.packed_bias) ? OptionalTensor(w.packed_bias->chunk(3)[part]) : w.biases[part];
    TORCHMHA_CHECK_ARG(
        features[part] < 0 || !is_present(bias) || (bias->dim() == 1 && bias->size(0) == inner), "expecting ",
        kPartNames[part], " bias shape of (", inner, ",), but got ", torch_size(bias->sizes()));
  }
}

namespace {

// at::linear on the (len, N, E) layout that torch's functional forward projects (torch's module
// hands batch_first inputs over transposed). The layout matters in two cases, where at::linear
// takes another op on a strided 3-D input (matmul, then add) than on a contiguous one (addmm):
// a bias whose dtype is not the input's (promoted by the one, rejected by the other), and an input
// whose features do not fit the weight (the error names the op from torch 2.15 on).
Tensor linear_in_torch_layout(const Tensor& x, const Tensor& weight, const OptionalTensor& bias,
                              const OptionalTensor& scale, bool batch_first) {
  const bool bias_of_other_dtype = is_present(bias) && bias->scalar_type() != x.scalar_type();
  const bool misfit = x.dim() == 3 && weight.dim() == 2 && x.size(-1) != weight.size(1);
  if (!batch_first || x.dim() != 3 || !(bias_of_other_dtype || misfit) || is_present(scale)) {
    return linear_layer(x, weight, bias, scale);
  }
  return at::linear(x.transpose(0, 1), weight, bias).transpose(0, 1);
}

}  // namespace

std::vector<ProjectionGroup> project(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const InProjection& w,
    Sharing sharing,
    bool batch_first) {
  const Tensor* inputs[3] = {&query, &key, &value};
  const int64_t inner = w.inner();
  std::vector<ProjectionGroup> groups;
  for (const auto& [first, parts] : gemm_groups(w.packed(), sharing)) {
    if (!inputs[first]->defined()) {
      continue;
    }
    const Tensor weight = w.packed() ? *packed_rows(w.packed_weight, first, parts, inner) : *w.weights[first];
    const OptionalTensor scale = w.packed() ? packed_rows(w.packed_weight_scale, first, parts, inner) : std::nullopt;
    groups.push_back({first, parts,
                      linear_in_torch_layout(*inputs[first], weight, bias_of(w, first, parts, inner), scale,
                                             batch_first)});
  }
  return groups;
}

std::array<Tensor, 3> project_to_heads(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const InProjection& w,
    Sharing sharing,
    int64_t num_heads,
    bool batch_first) {
  std::array<Tensor, 3> heads;
  for (auto& group : project(query, key, value, w, sharing, batch_first)) {
    auto parts = to_heads(group.output, group.parts, num_heads, batch_first);
    for (int i = 0; i < group.parts; ++i) {
      heads[group.first_part + i] = std::move(parts[i]);
    }
  }
  return heads;
}

// Strided views: SDPA's CPU flash kernel reads them in place (a contiguous copy measured ~25%
// slower), and the explicit-weights path's reshape copies only where a batched matmul needs it.
std::vector<Tensor> to_heads(const Tensor& x, int64_t parts, int64_t num_heads, bool batch_first) {
  const int64_t head_dim = x.size(-1) / (parts * num_heads);
  auto split = x.unflatten(-1, {parts, num_heads, head_dim});
  auto heads = batch_first ? split.permute({2, 0, 3, 1, 4}) : split.permute({2, 1, 3, 0, 4});
  return heads.unbind(0);
}

Tensor merge_heads(const Tensor& x) {
  return x.permute({2, 0, 1, 3}).flatten(-2);  // a copy, as the heads are not adjacent in x
}

}  // namespace torchmha::core
