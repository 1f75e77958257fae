// torchmha._C: the Python extension. It loads libtorchmha (which registers torch.ops.torchmha.*),
// maps torchmha's ArgumentError to Python's AssertionError (the type torch raises for the same
// input), and exposes the C++ modules themselves for C++ interop (torchmha.cpp).
// The user-facing Python classes are plain nn.Modules in python/torchmha, not these bindings.

#include <torchmha/attention_versions.h>
#include <torchmha/errors.h>
#include <torchmha/multihead_attention.h>
#include <torchmha/serialization.h>

#include <torch/extension.h>
#include <torch/python.h>

namespace py = pybind11;

namespace {

std::optional<at::Tensor> none_if_undefined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

void bind_cpp_modules(py::module_& m) {
  using namespace torchmha;
  using py::arg;

  torch::python::bind_module<MultiheadAttentionV1Impl>(m, "MultiheadAttentionV1")
      .def(
          py::init([](int64_t embed_dim) { return std::make_shared<MultiheadAttentionV1Impl>(embed_dim); }),
          arg("embed_dim"))
      .def("forward", &MultiheadAttentionV1Impl::forward, arg("x"));

  torch::python::bind_module<MultiheadAttentionV2Impl>(m, "MultiheadAttentionV2")
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, double dropout) {
            return std::make_shared<MultiheadAttentionV2Impl>(
                MultiheadAttentionV2Options(embed_dim, num_heads).dropout(dropout));
          }),
          arg("embed_dim"), arg("num_heads"), arg("dropout") = 0.0)
      .def(
          "forward",
          [](MultiheadAttentionV2Impl& self, const at::Tensor& x, const std::optional<at::Tensor>& mask) {
            return self.forward(x, mask.value_or(at::Tensor()));
          },
          arg("x"), arg("mask") = py::none());

  torch::python::bind_module<MultiheadAttentionV3Impl>(m, "MultiheadAttentionV3")
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, std::optional<int64_t> kdim,
                      std::optional<int64_t> vdim, double dropout) {
            return std::make_shared<MultiheadAttentionV3Impl>(
                MultiheadAttentionV3Options(embed_dim, num_heads).kdim(kdim).vdim(vdim).dropout(dropout));
          }),
          arg("embed_dim"), arg("num_heads"), arg("kdim") = py::none(), arg("vdim") = py::none(),
          arg("dropout") = 0.0)
      .def(
          "forward",
          [](MultiheadAttentionV3Impl& self, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const std::optional<at::Tensor>& mask) { return self.forward(q, k, v, mask.value_or(at::Tensor())); },
          arg("query"), arg("key"), arg("value"), arg("mask") = py::none());

  torch::python::bind_module<MultiheadAttentionV4Impl>(m, "MultiheadAttentionV4")
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, double dropout) {
            return std::make_shared<MultiheadAttentionV4Impl>(
                MultiheadAttentionV4Options(embed_dim, num_heads).dropout(dropout));
          }),
          arg("embed_dim"), arg("num_heads"), arg("dropout") = 0.0)
      .def(
          "forward",
          [](MultiheadAttentionV4Impl& self, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const std::optional<at::Tensor>& mask) { return self.forward(q, k, v, mask.value_or(at::Tensor())); },
          arg("query"), arg("key"), arg("value"), arg("mask") = py::none());

  torch::python::bind_module<MultiheadAttentionImpl>(m, "MultiheadAttention")
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, double dropout, bool bias, bool add_bias_kv,
                      bool add_zero_attn, std::optional<int64_t> kdim, std::optional<int64_t> vdim,
                      bool batch_first) {
            return std::make_shared<MultiheadAttentionImpl>(MultiheadAttentionOptions(embed_dim, num_heads)
                                                                .dropout(dropout)
                                                                .bias(bias)
                                                                .add_bias_kv(add_bias_kv)
                                                                .add_zero_attn(add_zero_attn)
                                                                .kdim(kdim)
                                                                .vdim(vdim)
                                                                .batch_first(batch_first));
          }),
          arg("embed_dim"), arg("num_heads"), arg("dropout") = 0.0, arg("bias") = true,
          arg("add_bias_kv") = false, arg("add_zero_attn") = false, arg("kdim") = py::none(),
          arg("vdim") = py::none(), arg("batch_first") = false)
      .def(
          "forward",
          [](MultiheadAttentionImpl& self, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
             const std::optional<at::Tensor>& key_padding_mask, bool need_weights,
             const std::optional<at::Tensor>& attn_mask, bool average_attn_weights, bool is_causal) {
            auto [output, weights] = self.forward(
                query, key, value, key_padding_mask.value_or(at::Tensor()), need_weights,
                attn_mask.value_or(at::Tensor()), average_attn_weights, is_causal);
            return std::make_tuple(output, none_if_undefined(weights));
          },
          arg("query"), arg("key"), arg("value"), arg("key_padding_mask") = py::none(),
          arg("need_weights") = true, arg("attn_mask") = py::none(), arg("average_attn_weights") = true,
          arg("is_causal") = false);

  // The C++ checkpoint functions, so Python can check what C++ programs write and read.
  m.def(
      "save_state_dict",
      [](const torch::nn::Module& module, const std::string& path) { save_state_dict(module, path); },
      arg("module"), arg("path"));
  m.def(
      "load_state_dict",
      [](torch::nn::Module& module, const std::string& path) { load_state_dict(module, path); },
      arg("module"), arg("path"));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchmha C++ extension: registers torch.ops.torchmha and binds the C++ modules.";

  // Registered after torch's own translator, so it is tried first; anything else falls through.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const torchmha::ArgumentError& e) {
      PyErr_SetString(PyExc_AssertionError, e.what_without_backtrace());
    }
  });

  auto cpp = m.def_submodule("cpp", "The C++ modules, bound with torch::python::bind_module.");
  bind_cpp_modules(cpp);
}
