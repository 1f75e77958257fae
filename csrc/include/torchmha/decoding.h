#pragma once

// Beyond torch.nn.MultiheadAttention: key/value caching for incremental decoding, the source
// article's CrossAttention (own inner width heads * dim_head) and its Transformer block.
//
// Shapes: N batch, H heads, D head_dim, T new (query) positions, S key positions, M cache
// capacity. Query layouts follow batch_first: (T, N, E) or (N, T, E). Cached keys and values are
// (N, H, M, D). key_padding_mask follows torch: (N, S), bool true = ignore that key, or float
// added to the scores.

#include <torchmha/multihead_attention.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <tuple>

namespace torchmha {

// ------------------------------------------------------------------------ functional entry points

/// One step of incremental causal self-attention decoding. Projects `query` (T, N, E) or
/// (N, T, E) with w_q/w_k/w_v (inner, E) into H = k_cache.size(1) heads, writes the new keys and
/// values in place into k_cache, v_cache (N, H, M, D) at positions [cache_length,
/// cache_length + T), and lets query i (absolute position cache_length + i) attend to the cached
/// keys 0 .. cache_length + i. key_padding_mask covers every key so far: (N, cache_length + T).
/// Returns w_out-projected output in query's layout, last dim w_out.size(0).
/// The caller advances its cache length by T (KeyValueCache does). cache_length is a SymInt (an
/// int64_t converts implicitly) so that under torch.compile it stays symbolic and one graph
/// serves every length; taken by value, the type by which the dispatcher knows a SymInt kernel.
at::Tensor attention_with_cache(
    const at::Tensor& query,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    c10::SymInt cache_length,
    const at::Tensor& w_q,
    const std::optional<at::Tensor>& b_q,
    const at::Tensor& w_k,
    const std::optional<at::Tensor>& b_k,
    const at::Tensor& w_v,
    const std::optional<at::Tensor>& b_v,
    const at::Tensor& w_out,
    const std::optional<at::Tensor>& b_out,
    const std::optional<at::Tensor>& key_padding_mask = std::nullopt,
    double dropout_p = 0.0,
    bool training = false,
    bool batch_first = false);

/// Projects a fixed context (an encoder output) once: key (S, N, Ek) and value (S, N, Ev), or
/// (N, S, *) with batch_first, with w_k (inner, Ek), w_v (inner, Ev), split into num_heads
/// heads. Returns {keys, values}, each (N, H, S, inner / H).
std::tuple<at::Tensor, at::Tensor> project_key_value(
    const at::Tensor& key,
    const at::Tensor& value,
    int64_t num_heads,
    const at::Tensor& w_k,
    const std::optional<at::Tensor>& b_k,
    const at::Tensor& w_v,
    const std::optional<at::Tensor>& b_v,
    bool batch_first = false);

/// Attention of `query` (T, N, Eq) or (N, T, Eq) to keys and values already projected and split
/// into heads, (N, H, S, D) each (project_key_value's result): the cross-attention cache. No
/// causal mask; scale 1/sqrt(D). Returns w_out-projected output in query's layout.
at::Tensor attention_with_static_key_value(
    const at::Tensor& query,
    const at::Tensor& keys,
    const at::Tensor& values,
    const at::Tensor& w_q,
    const std::optional<at::Tensor>& b_q,
    const at::Tensor& w_out,
    const std::optional<at::Tensor>& b_out,
    const std::optional<at::Tensor>& key_padding_mask = std::nullopt,
    double dropout_p = 0.0,
    bool training = false,
    bool batch_first = false);

// --------------------------------------------------------------------------------- caches

/// Keys and values of a fixed context, projected once and reused on every decoding step
/// (the encoder-output cache of a decoder's cross-attention). keys, values: (N, H, S, D).
struct StaticKeyValue {
  at::Tensor keys;
  at::Tensor values;
};

/// A preallocated self-attention key/value cache: keys and values (N, H, max_length, D), of
/// which the first length() positions are filled. Each decoding step appends in place.
/// ```
/// auto cache = torchmha::KeyValueCache::for_module(*mha, /*batch_size=*/1, /*max_length=*/1024);
/// for (...) { auto y = mha->forward_with_cache(x_t, cache); }   // x_t: one new position
/// cache.reset();                                                 // next sequence, same batch
/// ```
class KeyValueCache {
 public:
  KeyValueCache(
      int64_t batch_size,
      int64_t num_heads,
      int64_t max_length,
      int64_t head_dim,
      at::TensorOptions options = at::TensorOptions());
  /// A cache matching `attention`'s heads, head_dim, dtype and device.
  static KeyValueCache for_module(const MultiheadAttentionImpl& attention, int64_t batch_size, int64_t max_length);

  /// Forgets the cached positions (keeps the storage).
  void reset();
  /// Forgets the cached positions and makes room for batches of `batch_size` (reallocates only if
  /// the batch size changes).
  void reset(int64_t batch_size);

  const at::Tensor& keys() const { return keys_; }
  const at::Tensor& values() const { return values_; }
  /// Positions filled so far.
  int64_t length() const { return length_; }
  int64_t batch_size() const { return keys_.size(0); }
  int64_t max_length() const { return keys_.size(2); }

  /// Runs attention_with_cache on this cache and advances length() by the query's T.
  at::Tensor attend(
      const at::Tensor& query,
      const at::Tensor& w_q,
      const std::optional<at::Tensor>& b_q,
      const at::Tensor& w_k,
      const std::optional<at::Tensor>& b_k,
      const at::Tensor& w_v,
      const std::optional<at::Tensor>& b_v,
      const at::Tensor& w_out,
      const std::optional<at::Tensor>& b_out,
      const std::optional<at::Tensor>& key_padding_mask,
      double dropout_p,
      bool training,
      bool batch_first);

 private:
  at::Tensor keys_, values_;
  int64_t length_ = 0;
};

// --------------------------------------------------------------------------- CrossAttention

/// Options for CrossAttention (the source article's, its defects removed).
struct CrossAttentionOptions {
  /* implicit */ CrossAttentionOptions(int64_t query_dim) : query_dim_(query_dim) {}
  /// Feature size of the input x and of the output.
  TORCH_ARG(int64_t, query_dim);
  /// Feature size of the context; defaults to query_dim.
  TORCH_ARG(std::optional<int64_t>, context_dim) = std::nullopt;
  /// Number of heads H.
  TORCH_ARG(int64_t, heads) = 8;
  /// Width D of each head; the inner width H * D may differ from query_dim.
  TORCH_ARG(int64_t, dim_head) = 64;
  /// Dropout after the output projection (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
};

/// Cross-attention with its own inner width: to_q Linear(query_dim, H*D), to_k and to_v
/// Linear(context_dim, H*D), all without bias; to_out Linear(H*D, query_dim) then dropout.
/// Scale D^-0.5. Batch first: x (N, L, query_dim), context (N, S, context_dim), defaulting to x.
/// mask (N, S): bool, **true = keep** (the article's convention, the opposite of torch's
/// key_padding_mask). A query whose keys are all masked gets NaN, as in torch.
/// ```
/// torchmha::CrossAttention attn(torchmha::CrossAttentionOptions(64).context_dim(32).heads(4).dim_head(16));
/// auto y = attn(torch::randn({2, 10, 64}), torch::randn({2, 7, 32}));  // (2, 10, 64)
/// ```
class CrossAttentionImpl : public torch::nn::Cloneable<CrossAttentionImpl> {
 public:
  explicit CrossAttentionImpl(const CrossAttentionOptions& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// x (N, L, query_dim); context (N, S, context_dim) or undefined (then x); mask (N, S) or
  /// undefined. Returns (N, L, query_dim).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {}, const at::Tensor& mask = {});
  /// The context's keys and values, (N, H, S, D) each, to reuse across decoding steps.
  StaticKeyValue project_context(const at::Tensor& context);
  /// forward() with the context already projected by project_context().
  at::Tensor forward_with_cache(const at::Tensor& x, const StaticKeyValue& context, const at::Tensor& mask = {});

  CrossAttentionOptions options;
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out{nullptr};
  torch::nn::Dropout dropout{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())}, {2, torch::nn::AnyValue(at::Tensor())})
};
TORCH_MODULE(CrossAttention);

// ------------------------------------------------------------------------- TransformerBlock

/// Options for TransformerBlock.
struct TransformerBlockOptions {
  TransformerBlockOptions(int64_t embed_dim, int64_t num_heads) : embed_dim_(embed_dim), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, embed_dim);
  TORCH_ARG(int64_t, num_heads);
  /// Dropout on the attention weights and on each sublayer's output (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
  /// Hidden width of the feed-forward network = forward_expansion * embed_dim.
  TORCH_ARG(int64_t, forward_expansion) = 4;
  /// Pre-norm (LayerNorm before each sublayer) instead of the article's post-norm.
  TORCH_ARG(bool, norm_first) = false;
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
};

/// The article's Transformer block on torchmha's attention, batch first (N, L, E) -> (N, L, E):
/// self-attention and a feed-forward network Linear(E, F) - ReLU - Linear(F, E), each with a
/// residual connection and LayerNorm, post-norm by default or pre-norm with norm_first. Submodule
/// names and dropout placement are torch.nn.TransformerEncoderLayer's (self_attn, linear1,
/// linear2, norm1, norm2), so with the same weights it computes the same function.
class TransformerBlockImpl : public torch::nn::Cloneable<TransformerBlockImpl> {
 public:
  TransformerBlockImpl(int64_t embed_dim, int64_t num_heads)
      : TransformerBlockImpl(TransformerBlockOptions(embed_dim, num_heads)) {}
  explicit TransformerBlockImpl(const TransformerBlockOptions& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// x (N, L, E); attn_mask (L, L) or (N*H, L, L) and key_padding_mask (N, L) as in
  /// torch.nn.MultiheadAttention (bool true = not allowed). Returns (N, L, E).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& attn_mask = {}, const at::Tensor& key_padding_mask = {});

  TransformerBlockOptions options;
  MultiheadAttention self_attn{nullptr};
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Dropout dropout{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())}, {2, torch::nn::AnyValue(at::Tensor())})
};
TORCH_MODULE(TransformerBlock);

}  // namespace torchmha
