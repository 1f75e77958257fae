// torchmha._C: the Python extension. It loads libtorchmha (which registers torch.ops.torchmha.*),
// maps torchmha's ArgumentError to Python's AssertionError (the type torch raises for the same
// input), gives the Python classes the core's construction-time rules (so each lives once, in
// C++), and exposes the C++ modules themselves for C++ interop (torchmha.cpp).
// The user-facing Python classes are plain nn.Modules in python/torchmha, not these bindings.

#include <torchmha/torchmha.h>

#include "core/cached_decoder.h"
#include "core/checks.h"
#include "core/fast_path.h"
#include "core/layers.h"

#include <torch/extension.h>
#include <torch/python.h>

namespace py = pybind11;

namespace {

// A C++ module's forward called from Python behaves as torch's module there: it follows
// torch.backends.mha's fast-path switch, and its TORCH_WARNs become Python warnings (torch's own
// bindings do the same with PyWarningHandler), so warning filters see them.
template <typename Fn>
auto as_python_forward(Fn&& forward) {
  const bool fast_path = py::module_::import("torch.backends.mha").attr("get_fastpath_enabled")().cast<bool>();
  torchmha::core::FastPathOverride fast_path_override(fast_path);
  torch::PyWarningHandler warnings;
  try {
    return forward();
  } catch (...) {
    warnings.set_in_exception();
    throw;
  }
}

// Construction-time rules of the core, for the Python classes' constructors (never traced, so
// plain functions rather than ops).
void bind_rules(py::module_& m) {
  using py::arg;
  namespace core = torchmha::core;
  m.def("_check_module_sizes", &core::check_module_sizes, arg("embed_dim"), arg("num_heads"), arg("kdim") = -1,
        arg("vdim") = -1);
  m.def("_check_cross_attention_sizes", &core::check_cross_attention_sizes, arg("query_dim"), arg("context_dim"),
        arg("heads"), arg("dim_head"));
  m.def("_check_forward_expansion", &core::check_forward_expansion, arg("forward_expansion"));
  m.def(
      "_key_value_cache",
      [](int64_t batch_size, int64_t num_heads, int64_t max_length, int64_t head_dim,
         std::optional<at::ScalarType> dtype, std::optional<at::Device> device) {
        torchmha::KeyValueCache cache(
            batch_size, num_heads, max_length, head_dim, at::TensorOptions().dtype(dtype).device(device));
        return std::make_tuple(cache.keys(), cache.values());
      },
      arg("batch_size"), arg("num_heads"), arg("max_length"), arg("head_dim"), arg("dtype") = py::none(),
      arg("device") = py::none());
}

// What CachedDecoder's Python shell checks before each step, in C++ because of where a step leaves
// the caches: its weights have streamed through them, so every Python object the check touches is
// a miss, and a Python loop touches more of them (each value it loads, each frame). These touch
// only what they compare.
void bind_step_checks(py::module_& m) {
  // True if every (dict, key, value) of `entries` still holds: dict[key] is value (identity; the
  // dicts' own entries are read, not copied).
  m.def("_entries_unchanged", [](const py::list& entries) {
    for (const auto& entry : entries) {
      PyObject* e = entry.ptr();
      if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 3 || !PyDict_Check(PyTuple_GET_ITEM(e, 0))) {
        throw py::type_error("_entries_unchanged expects (dict, key, value) tuples");
      }
      PyObject* now = PyDict_GetItemWithError(PyTuple_GET_ITEM(e, 0), PyTuple_GET_ITEM(e, 1));  // borrowed
      if (now == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      if (now != PyTuple_GET_ITEM(e, 2)) {
        return false;
      }
    }
    return true;
  });
  // (identity, version, data pointer) of the tensors at `slots` of `tensors`, flattened: what
  // changes when one is replaced, written in place, or given new data (`.data =`, a move or cast
  // by module.to()). Read from the Python objects in place (a list of 36 weights converted to
  // at::Tensor first, and their ids taken in Python, cost 8 us of a step's 12 in the shell).
  m.def("_tensor_stamps", [](const py::list& tensors, const std::vector<int64_t>& slots) {
    std::vector<int64_t> stamps;
    stamps.reserve(3 * slots.size());
    for (const int64_t slot : slots) {
      PyObject* object = PyList_GetItem(tensors.ptr(), static_cast<Py_ssize_t>(slot));  // borrowed
      if (object == nullptr || !THPVariable_Check(object)) {
        PyErr_Clear();
        throw py::type_error("_tensor_stamps expects a tensor at each slot");
      }
      const at::Tensor& t = THPVariable_Unpack(object);
      stamps.push_back(reinterpret_cast<int64_t>(object));
      stamps.push_back(torchmha::core::weight_version(t));
      stamps.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    }
    return stamps;
  }, py::arg("tensors"), py::arg("slots"));
}

// torch's bind_module, with `forward` and `__call__` bound to `forward` (a binding with torch's
// Python signature): the plain bind_module also binds the C++ forward itself to both, and that
// overload would win for positional calls.
template <typename Impl, typename Forward, typename... Extra>
auto bind_module_with_forward(py::module_& m, const char* name, Forward forward, const Extra&... extra) {
  return torch::python::bind_module<Impl, /*force_enable=*/true>(m, name)
      .def("forward", forward, extra...)
      .def("__call__", forward, extra...);
}

// The article's v1-v4 (attention_versions.h).
void bind_versions(py::module_& m) {
  using namespace torchmha;
  using py::arg;

  bind_module_with_forward<MultiheadAttentionV1Impl>(m, "MultiheadAttentionV1", &MultiheadAttentionV1Impl::forward, arg("x"))
      .def(
          py::init([](int64_t embed_dim) { return std::make_shared<MultiheadAttentionV1Impl>(embed_dim); }),
          arg("embed_dim"));

  bind_module_with_forward<MultiheadAttentionV2Impl>(
      m, "MultiheadAttentionV2",
      [](MultiheadAttentionV2Impl& self, const at::Tensor& x, const std::optional<at::Tensor>& mask) {
        return self.forward(x, mask.value_or(at::Tensor()));
      },
      arg("x"), arg("mask") = py::none())
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, double dropout) {
            return std::make_shared<MultiheadAttentionV2Impl>(
                MultiheadAttentionV2Options(embed_dim, num_heads).dropout(dropout));
          }),
          arg("embed_dim"), arg("num_heads"), arg("dropout") = 0.0);

  bind_module_with_forward<MultiheadAttentionV3Impl>(
      m, "MultiheadAttentionV3",
      [](MultiheadAttentionV3Impl& self, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::optional<at::Tensor>& mask) { return self.forward(q, k, v, mask.value_or(at::Tensor())); },
      arg("query"), arg("key"), arg("value"), arg("mask") = py::none())
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, std::optional<int64_t> kdim,
                      std::optional<int64_t> vdim, double dropout) {
            return std::make_shared<MultiheadAttentionV3Impl>(
                MultiheadAttentionV3Options(embed_dim, num_heads).kdim(kdim).vdim(vdim).dropout(dropout));
          }),
          arg("embed_dim"), arg("num_heads"), arg("kdim") = py::none(), arg("vdim") = py::none(),
          arg("dropout") = 0.0);

  bind_module_with_forward<MultiheadAttentionV4Impl>(
      m, "MultiheadAttentionV4",
      [](MultiheadAttentionV4Impl& self, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::optional<at::Tensor>& mask) { return self.forward(q, k, v, mask.value_or(at::Tensor())); },
      arg("query"), arg("key"), arg("value"), arg("mask") = py::none())
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, double dropout) {
            return std::make_shared<MultiheadAttentionV4Impl>(
                MultiheadAttentionV4Options(embed_dim, num_heads).dropout(dropout));
          }),
          arg("embed_dim"), arg("num_heads"), arg("dropout") = 0.0);
}

// MultiheadAttention with its cache methods; torch's Python signature.
void bind_multihead_attention(py::module_& m) {
  using namespace torchmha;
  using py::arg;

  bind_module_with_forward<MultiheadAttentionImpl>(
      m, "MultiheadAttention",
      [](MultiheadAttentionImpl& self, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         const std::optional<at::Tensor>& key_padding_mask, bool need_weights,
         const std::optional<at::Tensor>& attn_mask, bool average_attn_weights, bool is_causal) {
        auto [output, weights] = as_python_forward([&] {
          return self.forward(
              query, key, value, key_padding_mask.value_or(at::Tensor()), need_weights,
              attn_mask.value_or(at::Tensor()), average_attn_weights, is_causal);
        });
        return std::make_tuple(output, torchmha::optional_if_defined(weights));
      },
      arg("query"), arg("key"), arg("value"), arg("key_padding_mask") = py::none(),
      arg("need_weights") = true, arg("attn_mask") = py::none(), arg("average_attn_weights") = true,
      arg("is_causal") = false)
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
          "forward_with_cache",
          [](MultiheadAttentionImpl& self, const at::Tensor& query, py::object cache,
             const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& new_lengths) {
            const at::Tensor mask = key_padding_mask.value_or(at::Tensor());
            if (py::isinstance<KeyValueCache>(cache)) {
              return self.forward_with_cache(query, cache.cast<KeyValueCache&>(), mask,
                                             new_lengths.value_or(at::Tensor()));
            }
            TORCH_CHECK_VALUE(!new_lengths.has_value(), "forward_with_cache: new_lengths is for a KeyValueCache");
            return self.forward_with_cache(query, cache.cast<const StaticKeyValue&>(), mask);
          },
          arg("query"), arg("cache"), arg("key_padding_mask") = py::none(), arg("new_lengths") = py::none())
      .def(
          "project_key_value",
          [](MultiheadAttentionImpl& self, const at::Tensor& key, const std::optional<at::Tensor>& value) {
            return self.project_key_value(key, value.value_or(at::Tensor()));
          },
          arg("key"), arg("value") = py::none());
}

// The C++ checkpoint functions (serialization.h), so Python can check what C++ programs write and read.
void bind_serialization(py::module_& m) {
  using namespace torchmha;
  using py::arg;
  m.def(
      "save_state_dict",
      [](const torch::nn::Module& module, const std::string& path) { save_state_dict(module, path); },
      arg("module"), arg("path"));
  m.def(
      "load_state_dict",
      [](torch::nn::Module& module, const std::string& path) { load_state_dict(module, path); },
      arg("module"), arg("path"));
}

// Decoding caches (kv_cache.h), bound before the modules whose methods take them.
void bind_caches(py::module_& m) {
  using namespace torchmha;
  using py::arg;

  py::class_<StaticKeyValue>(m, "StaticKeyValue")
      .def(py::init([](const at::Tensor& keys, const at::Tensor& values) { return StaticKeyValue{keys, values}; }),
           arg("keys"), arg("values"))
      .def_readwrite("keys", &StaticKeyValue::keys)
      .def_readwrite("values", &StaticKeyValue::values);

  py::class_<KeyValueCache>(m, "KeyValueCache")
      .def(
          py::init([](int64_t batch_size, int64_t num_heads, int64_t max_length, int64_t head_dim,
                      std::optional<at::ScalarType> dtype) {
            return KeyValueCache(
                batch_size, num_heads, max_length, head_dim, at::TensorOptions().dtype(dtype));
          }),
          arg("batch_size"), arg("num_heads"), arg("max_length"), arg("head_dim"), arg("dtype") = py::none())
      .def_static(
          "for_module",
          [](py::object module, int64_t batch_size, int64_t max_length) {
            // Accepts the torch.nn.cpp.ModuleWrapper users hold as well as the bound class itself.
            py::object raw = py::hasattr(module, "cpp_module") ? module.attr("cpp_module") : module;
            return KeyValueCache::for_module(raw.cast<const MultiheadAttentionImpl&>(), batch_size, max_length);
          },
          arg("module"), arg("batch_size"), arg("max_length"))
      .def(
          "reset",
          [](KeyValueCache& self, const std::optional<at::Tensor>& slots, std::optional<int64_t> batch_size) {
            if (batch_size.has_value()) {
              self.reset(*batch_size);
            } else if (slots.has_value()) {
              self.reset(*slots);
            } else {
              self.reset();
            }
          },
          arg("slots") = py::none(), py::kw_only(), arg("batch_size") = py::none())
      .def("reorder", &KeyValueCache::reorder, arg("indices"))
      .def_property_readonly("keys", &KeyValueCache::keys)
      .def_property_readonly("values", &KeyValueCache::values)
      .def_property_readonly("lengths", &KeyValueCache::lengths)
      .def_property_readonly("length", &KeyValueCache::length)
      .def_property_readonly("batch_size", &KeyValueCache::batch_size)
      .def_property_readonly("max_length", &KeyValueCache::max_length);
}

// The article's layers (cross_attention.h, transformer_block.h).
void bind_layers(py::module_& m) {
  using namespace torchmha;
  using py::arg;

  bind_module_with_forward<CrossAttentionImpl>(
      m, "CrossAttention",
      [](CrossAttentionImpl& self, const at::Tensor& x, const std::optional<at::Tensor>& context,
         const std::optional<at::Tensor>& mask) {
        return self.forward(x, context.value_or(at::Tensor()), mask.value_or(at::Tensor()));
      },
      arg("x"), arg("context") = py::none(), arg("mask") = py::none())
      .def(
          py::init([](int64_t query_dim, std::optional<int64_t> context_dim, int64_t heads, int64_t dim_head,
                      double dropout) {
            return std::make_shared<CrossAttentionImpl>(
                CrossAttentionOptions(query_dim).context_dim(context_dim).heads(heads).dim_head(dim_head).dropout(dropout));
          }),
          arg("query_dim"), arg("context_dim") = py::none(), arg("heads") = 8, arg("dim_head") = 64,
          arg("dropout") = 0.0)

      .def("project_context", &CrossAttentionImpl::project_context, arg("context"))
      .def(
          "forward_with_cache",
          [](CrossAttentionImpl& self, const at::Tensor& x, const StaticKeyValue& context,
             const std::optional<at::Tensor>& mask) {
            return self.forward_with_cache(x, context, mask.value_or(at::Tensor()));
          },
          arg("x"), arg("context"), arg("mask") = py::none());

  bind_module_with_forward<TransformerBlockImpl>(
      m, "TransformerBlock",
      [](TransformerBlockImpl& self, const at::Tensor& x, const std::optional<at::Tensor>& attn_mask,
         const std::optional<at::Tensor>& key_padding_mask) {
        return as_python_forward([&] {
          return self.forward(x, attn_mask.value_or(at::Tensor()), key_padding_mask.value_or(at::Tensor()));
        });
      },
      arg("x"), arg("attn_mask") = py::none(), arg("key_padding_mask") = py::none())
      .def(
          py::init([](int64_t embed_dim, int64_t num_heads, double dropout, int64_t forward_expansion, bool norm_first) {
            return std::make_shared<TransformerBlockImpl>(TransformerBlockOptions(embed_dim, num_heads)
                                                              .dropout(dropout)
                                                              .forward_expansion(forward_expansion)
                                                              .norm_first(norm_first));
          }),
          arg("embed_dim"), arg("num_heads"), arg("dropout") = 0.0, arg("forward_expansion") = 4,
          arg("norm_first") = false);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchmha C++ extension: registers torch.ops.torchmha and binds the C++ modules.";

  // ArgumentError is raised as Python's AssertionError where it is thrown, so it reaches Python
  // as such through every path: this extension's bindings and torch.ops on every torch release
  // (from 2.15 on torch.ops turns any other c10::Error into RuntimeError before pybind11's
  // translators see it).
  torchmha::detail::set_argument_error_translator([](const torchmha::ArgumentError& e) {
    py::gil_scoped_acquire gil;
    PyErr_SetString(PyExc_AssertionError, e.what_without_backtrace());
    throw py::error_already_set();
  });

  m.attr("__version__") = TORCHMHA_VERSION;
  bind_rules(m);
  bind_step_checks(m);
  auto cpp = m.def_submodule("cpp", "The C++ modules, bound with torch::python::bind_module.");
  bind_caches(cpp);
  bind_versions(cpp);
  bind_multihead_attention(cpp);
  bind_serialization(cpp);
  bind_layers(cpp);
}
