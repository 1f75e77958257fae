// C++ modules: the article's v1-v4 and the full MultiheadAttention. Each holds its parameters
// and calls the functional core; none computes attention itself.

#include <torchmha/attention_versions.h>
#include <torchmha/errors.h>
#include <torchmha/functional.h>
#include <torchmha/multihead_attention.h>

#include <ATen/ATen.h>
#include <torch/nn/init.h>

namespace torchmha {
namespace {

using at::Tensor;
using torch::nn::Linear;
using torch::nn::LinearOptions;

using detail::optional_if_defined;

void check_sizes(int64_t embed_dim, int64_t num_heads) {
  TORCH_CHECK_VALUE(
      embed_dim > 0 && num_heads > 0, "embed_dim and num_heads must be greater than 0, got embed_dim=",
      embed_dim, " and num_heads=", num_heads);
  TORCHMHA_CHECK_ARG(
      embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads, got embed_dim=", embed_dim,
      " and num_heads=", num_heads);
}

// v1-v3 share their layout: four Linear layers q_proj, k_proj, v_proj (kdim/vdim -> E), out_proj.
template <typename Impl>
void register_separate_projections(Impl& self, int64_t embed_dim, int64_t kdim, int64_t vdim) {
  self.q_proj = self.register_module("q_proj", Linear(embed_dim, embed_dim));
  self.k_proj = self.register_module("k_proj", Linear(kdim, embed_dim));
  self.v_proj = self.register_module("v_proj", Linear(vdim, embed_dim));
  self.out_proj = self.register_module("out_proj", Linear(embed_dim, embed_dim));
}

// Attention through separate q/k/v projections, as torch.nn.MultiheadAttention with kdim/vdim.
template <typename Impl>
Tensor separate_projection_attention(
    const Impl& self,
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    int64_t num_heads,
    double dropout,
    const Tensor& attn_mask) {
  const int64_t embed_dim = self.q_proj->options.out_features();
  auto in_proj_bias = at::cat({self.q_proj->bias, self.k_proj->bias, self.v_proj->bias});
  return std::get<0>(multi_head_attention_forward(
      query, key, value, embed_dim, num_heads, /*in_proj_weight=*/std::nullopt, in_proj_bias,
      /*bias_k=*/std::nullopt, /*bias_v=*/std::nullopt, /*add_zero_attn=*/false, dropout,
      self.out_proj->weight, self.out_proj->bias, self.is_training(), /*key_padding_mask=*/std::nullopt,
      /*need_weights=*/false, optional_if_defined(attn_mask), self.q_proj->weight, self.k_proj->weight,
      self.v_proj->weight));
}

}  // namespace

// ---------------------------------------------------------------------------------------- v1
MultiheadAttentionV1Impl::MultiheadAttentionV1Impl(const MultiheadAttentionV1Options& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionV1Impl::reset() {
  check_sizes(options.embed_dim(), 1);
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
  check_sizes(options.embed_dim(), options.num_heads());
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
  check_sizes(options.embed_dim(), options.num_heads());
  const int64_t kdim = options.kdim().value_or(options.embed_dim());
  const int64_t vdim = options.vdim().value_or(options.embed_dim());
  TORCH_CHECK_VALUE(kdim > 0 && vdim > 0, "kdim and vdim must be greater than 0, got ", kdim, " and ", vdim);
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
  check_sizes(options.embed_dim(), options.num_heads());
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
  return std::get<0>(multi_head_attention_forward(
      query, key, value, options.embed_dim(), options.num_heads(), in_proj->weight, in_proj->bias,
      std::nullopt, std::nullopt, /*add_zero_attn=*/false, options.dropout(), out_proj->weight,
      out_proj->bias, is_training(), std::nullopt, /*need_weights=*/false, optional_if_defined(attn_mask)));
}

// -------------------------------------------------------------------------- MultiheadAttention
MultiheadAttentionImpl::MultiheadAttentionImpl(const MultiheadAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionImpl::reset() {
  const int64_t E = options.embed_dim();
  check_sizes(E, options.num_heads());
  const int64_t kdim = options.kdim().value_or(E);
  const int64_t vdim = options.vdim().value_or(E);
  head_dim = E / options.num_heads();
  qkv_same_embed_dim = kdim == E && vdim == E;
  // Registration order and names as torch.nn.MultiheadAttention, so state dicts line up; absent
  // parameters are registered undefined, as torch registers None.
  auto param = [&](const char* name, at::IntArrayRef shape, bool present) {
    return register_parameter(name, present ? torch::empty(shape) : Tensor(), /*requires_grad=*/present);
  };
  in_proj_weight = param("in_proj_weight", {3 * E, E}, qkv_same_embed_dim);
  q_proj_weight = param("q_proj_weight", {E, E}, !qkv_same_embed_dim);
  k_proj_weight = param("k_proj_weight", {E, kdim}, !qkv_same_embed_dim);
  v_proj_weight = param("v_proj_weight", {E, vdim}, !qkv_same_embed_dim);
  in_proj_bias = param("in_proj_bias", {3 * E}, options.bias());
  // out_proj's own initialisation draws from the RNG before reset_parameters, as in torch.
  out_proj = register_module("out_proj", Linear(LinearOptions(E, E).bias(options.bias())));
  bias_k = param("bias_k", {1, 1, E}, options.add_bias_kv());
  bias_v = param("bias_v", {1, 1, E}, options.add_bias_kv());
  reset_parameters();
}

void MultiheadAttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (qkv_same_embed_dim) {
    torch::nn::init::xavier_uniform_(in_proj_weight);
  } else {
    torch::nn::init::xavier_uniform_(q_proj_weight);
    torch::nn::init::xavier_uniform_(k_proj_weight);
    torch::nn::init::xavier_uniform_(v_proj_weight);
  }
  if (in_proj_bias.defined()) {
    in_proj_bias.zero_();
    out_proj->bias.zero_();
  }
  if (bias_k.defined()) {
    torch::nn::init::xavier_normal_(bias_k);
    torch::nn::init::xavier_normal_(bias_v);
  }
}

void MultiheadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmha::MultiheadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads() << ", dropout=" << options.dropout()
         << ", bias=" << options.bias() << ", add_bias_kv=" << options.add_bias_kv()
         << ", add_zero_attn=" << options.add_zero_attn()
         << ", kdim=" << options.kdim().value_or(options.embed_dim())
         << ", vdim=" << options.vdim().value_or(options.embed_dim())
         << ", batch_first=" << options.batch_first() << ")";
}

std::tuple<Tensor, Tensor> MultiheadAttentionImpl::forward(
    const Tensor& query,
    const Tensor& key,
    const Tensor& value,
    const Tensor& key_padding_mask,
    bool need_weights,
    const Tensor& attn_mask,
    bool average_attn_weights,
    bool is_causal) {
  // torch warns in Python (torchmha's Python classes too); LibTorch programs get the same warning here.
  if (key_padding_mask.defined() && attn_mask.defined() &&
      key_padding_mask.scalar_type() != attn_mask.scalar_type()) {
    TORCH_WARN(
        "key_padding_mask (", key_padding_mask.scalar_type(), ") and attn_mask (", attn_mask.scalar_type(),
        ") have different dtypes; mixing them is deprecated in torch.nn.MultiheadAttention: use one dtype for both.");
  }
  return multi_head_attention_forward(
      query, key, value, options.embed_dim(), options.num_heads(), optional_if_defined(in_proj_weight),
      optional_if_defined(in_proj_bias), optional_if_defined(bias_k), optional_if_defined(bias_v),
      options.add_zero_attn(), options.dropout(), out_proj->weight, optional_if_defined(out_proj->bias),
      is_training(), optional_if_defined(key_padding_mask), need_weights, optional_if_defined(attn_mask),
      optional_if_defined(q_proj_weight), optional_if_defined(k_proj_weight), optional_if_defined(v_proj_weight),
      average_attn_weights, is_causal, options.batch_first(), /*allow_fast_path=*/true);
}

}  // namespace torchmha
