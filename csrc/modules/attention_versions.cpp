// The article's v1-v4 (attention_versions.h; docs/versions.md). Each owns its parameters and makes one call into
// the functional core.

#include <torchmha/attention_versions.h>
#include <torchmha/functional.h>

#include "core/checks.h"
#include "core/common.h"

namespace torchmha {
namespace {

using at::Tensor;
using torch::nn::Linear;

// v1-v3 share their layout: four Linear layers q_proj, k_proj, v_proj (kdim/vdim -> E), out_proj.
template <typename Impl>
void register_separate_projections(Impl& self, int64_t embed_dim, int64_t kdim, int64_t vdim) {
  self.q_proj = self.register_module("q_proj", Linear(embed_dim, embed_dim));
  self.k_proj = self.register_module("k_proj", Linear(kdim, embed_dim));
  self.v_proj = self.register_module("v_proj", Linear(vdim, embed_dim));
  self.out_proj = self.register_module("out_proj", Linear(embed_dim, embed_dim));
}

// The versions' one call: no weights returned, the module's mode and dropout.
template <typename Impl>
Tensor versions_forward(const Impl& self, const Tensor& query, const Tensor& key, const Tensor& value,
                        const AttentionParameters& params, double dropout, const Tensor& attn_mask) {
  AttentionOptions call;
  call.attn_mask = optional_if_defined(attn_mask);
  call.need_weights = false;
  call.training = self.is_training();
  call.dropout_p = dropout;
  return std::get<0>(multi_head_attention_forward(query, key, value, params.out_proj_weight->size(0), params, call));
}

// Attention through the separate q/k/v Linear layers and their own biases.
template <typename Impl>
Tensor separate_projection_attention(
    const Impl& self,
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    int64_t num_heads,
    double dropout,
    const Tensor& attn_mask) {
  AttentionParameters params;
  params.num_heads = num_heads;
  params.q_proj_weight = self.q_proj->weight;
  params.k_proj_weight = self.k_proj->weight;
  params.v_proj_weight = self.v_proj->weight;
  params.q_proj_bias = self.q_proj->bias;
  params.k_proj_bias = self.k_proj->bias;
  params.v_proj_bias = self.v_proj->bias;
  params.out_proj_weight = self.out_proj->weight;
  params.out_proj_bias = self.out_proj->bias;
  return versions_forward(self, query, key, value, params, dropout, attn_mask);
}

}  // namespace

// ---------------------------------------------------------------------------------------- v1
MultiheadAttentionV1Impl::MultiheadAttentionV1Impl(const MultiheadAttentionV1Options& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionV1Impl::reset() {
  core::check_module_sizes(options.embed_dim(), 1);
  register_separate_projections(*this, options.embed_dim(), options.embed_dim(), options.embed_dim());
}

void MultiheadAttentionV1Impl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::MultiheadAttentionV1(embed_dim=" << options.embed_dim() << ")";
}

Tensor MultiheadAttentionV1Impl::forward(const Tensor& x) {
  return separate_projection_attention(*this, x, x, x, /*num_heads=*/1, /*dropout=*/0.0, Tensor());
}

// ---------------------------------------------------------------------------------------- v2
MultiheadAttentionV2Impl::MultiheadAttentionV2Impl(const MultiheadAttentionV2Options& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionV2Impl::reset() {
  core::check_module_sizes(options.embed_dim(), options.num_heads());
  register_separate_projections(*this, options.embed_dim(), options.embed_dim(), options.embed_dim());
}

void MultiheadAttentionV2Impl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::MultiheadAttentionV2(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads() << ", dropout=" << options.dropout() << ")";
}

Tensor MultiheadAttentionV2Impl::forward(const Tensor& x, const Tensor& attn_mask) {
  return separate_projection_attention(*this, x, x, x, options.num_heads(), options.dropout(), attn_mask);
}

// ---------------------------------------------------------------------------------------- v3
MultiheadAttentionV3Impl::MultiheadAttentionV3Impl(const MultiheadAttentionV3Options& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionV3Impl::reset() {
  const int64_t kdim = options.kdim().value_or(options.embed_dim());
  const int64_t vdim = options.vdim().value_or(options.embed_dim());
  core::check_module_sizes(options.embed_dim(), options.num_heads(), kdim, vdim);
  register_separate_projections(*this, options.embed_dim(), kdim, vdim);
}

void MultiheadAttentionV3Impl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::MultiheadAttentionV3(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads()
         << ", kdim=" << options.kdim().value_or(options.embed_dim())
         << ", vdim=" << options.vdim().value_or(options.embed_dim()) << ", dropout=" << options.dropout()
         << ")";
}

Tensor MultiheadAttentionV3Impl::forward(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const Tensor& attn_mask) {
  return separate_projection_attention(*this, query, key, value, options.num_heads(), options.dropout(), attn_mask);
}

// ---------------------------------------------------------------------------------------- v4
MultiheadAttentionV4Impl::MultiheadAttentionV4Impl(const MultiheadAttentionV4Options& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionV4Impl::reset() {
  core::check_module_sizes(options.embed_dim(), options.num_heads());
  in_proj = register_module("in_proj", Linear(options.embed_dim(), 3 * options.embed_dim()));
  out_proj = register_module("out_proj", Linear(options.embed_dim(), options.embed_dim()));
}

void MultiheadAttentionV4Impl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::MultiheadAttentionV4(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads() << ", dropout=" << options.dropout() << ")";
}

Tensor MultiheadAttentionV4Impl::forward(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const Tensor& attn_mask) {
  AttentionParameters params;
  params.num_heads = options.num_heads();
  params.in_proj_weight = in_proj->weight;
  params.in_proj_bias = in_proj->bias;
  params.out_proj_weight = out_proj->weight;
  params.out_proj_bias = out_proj->bias;
  return versions_forward(*this, query, key, value, params, options.dropout(), attn_mask);
}

}  // namespace torchmha
