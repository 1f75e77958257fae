// The one place torchmha's ops are registered with the dispatcher (torch.ops.torchmha.*).
// This translation unit lives in libtorchmha, which the Python extension and C++ programs both
// load, so TORCH_LIBRARY runs once per process. The kernels are CompositeImplicitAutograd: written
// in differentiable ATen ops, they get autograd, fake/meta tensors and torch.compile for free.

#include <torchmha/decoding.h>
#include <torchmha/functional.h>

#include <torch/library.h>

TORCH_LIBRARY(torchmha, m) {
  m.def(
      "in_projection_packed(Tensor q, Tensor k, Tensor v, Tensor w, Tensor? b=None) -> Tensor[]",
      TORCH_FN(torchmha::in_projection_packed));
  m.def(
      "in_projection(Tensor q, Tensor k, Tensor v, Tensor w_q, Tensor w_k, Tensor w_v, "
      "Tensor? b_q=None, Tensor? b_k=None, Tensor? b_v=None) -> Tensor[]",
      TORCH_FN(torchmha::in_projection));
  m.def(
      "multi_head_attention_forward(Tensor query, Tensor key, Tensor value, int embed_dim, "
      "int num_heads, Tensor? in_proj_weight, Tensor? in_proj_bias, Tensor? bias_k, Tensor? bias_v, "
      "bool add_zero_attn, float dropout_p, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "bool training=True, Tensor? key_padding_mask=None, bool need_weights=True, "
      "Tensor? attn_mask=None, Tensor? q_proj_weight=None, Tensor? k_proj_weight=None, "
      "Tensor? v_proj_weight=None, bool average_attn_weights=True, bool is_causal=False, "
      "bool batch_first=False, bool allow_fast_path=False) -> (Tensor, Tensor)",
      TORCH_FN(torchmha::multi_head_attention_forward));
  // Decoding (decoding.h). attention_with_cache writes the step's keys and values into the
  // caches in place, which the schema declares (a!)/(b!).
  m.def(
      "attention_with_cache(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, SymInt cache_length, "
      "Tensor w_q, Tensor? b_q, Tensor w_k, Tensor? b_k, Tensor w_v, Tensor? b_v, Tensor w_out, Tensor? b_out, "
      "Tensor? key_padding_mask=None, float dropout_p=0., bool training=False, bool batch_first=False) -> Tensor",
      TORCH_FN(torchmha::attention_with_cache));
  m.def(
      "project_key_value(Tensor key, Tensor value, int num_heads, Tensor w_k, Tensor? b_k, Tensor w_v, "
      "Tensor? b_v, bool batch_first=False) -> (Tensor, Tensor)",
      TORCH_FN(torchmha::project_key_value));
  m.def(
      "attention_with_static_key_value(Tensor query, Tensor keys, Tensor values, Tensor w_q, Tensor? b_q, "
      "Tensor w_out, Tensor? b_out, Tensor? key_padding_mask=None, float dropout_p=0., bool training=False, "
      "bool batch_first=False) -> Tensor",
      TORCH_FN(torchmha::attention_with_static_key_value));
}
