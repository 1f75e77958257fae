// Cross-language checkpoints: state dicts in torch.save's format. Reading uses torch::pickle_load.
// Writing does what torch::pickle_save does, but with the pickler's type tags off: tagged dicts
// unpickle through torch.jit._pickle.restore_type_tag, which torch.load(weights_only=True), the
// default since torch 2.6, refuses. Untagged, the file is a plain dict of tensors, as torch.save
// writes it.

#include <torchmha/serialization.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <fstream>
#include <iterator>
#include <vector>

namespace torchmha {

StateDict state_dict(const torch::nn::Module& module) {
  StateDict state;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    state.insert(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    state.insert(item.key(), item.value());
  }
  return state;
}

void save_state_dict(const StateDict& state, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state) {
    // Detached: torch.load would otherwise hand back leaf tensors that require grad.
    dict.insert(item.key(), item.value().detach());
  }
  std::vector<char> pickle_bytes;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { pickle_bytes.insert(pickle_bytes.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(dict);
  pickler.stop();
  // The zip layout of torch.save: data.pkl, and data/<i> for the i-th tensor's storage.
  caffe2::serialize::PyTorchStreamWriter writer(path);
  torch::jit::writeArchiveAndTensors("data", pickle_bytes.data(), pickle_bytes.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
}

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  save_state_dict(state_dict(module), path);
}

StateDict read_state_dict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "torchmha::read_state_dict: cannot open ", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  at::IValue loaded;
  try {
    loaded = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    // The usual cause: LibTorch's unpickler cannot rebuild the OrderedDict (with its _metadata)
    // that Python's state_dict() returns; a plain dict of the same items reads fine.
    TORCH_CHECK(
        false, "torchmha::read_state_dict: cannot read ", path, ": ", e.what_without_backtrace(),
        "\nA state dict saved in Python must be a plain dict: torch.save(dict(model.state_dict()), path)");
  }
  TORCH_CHECK(
      loaded.isGenericDict(), "torchmha::read_state_dict: ", path, " holds a ", loaded.tagKind(),
      ", not a dict of name -> tensor");
  StateDict state;
  for (const auto& entry : loaded.toGenericDict()) {
    TORCH_CHECK(
        entry.key().isString() && entry.value().isTensor(), "torchmha::read_state_dict: ", path,
        " has an entry that is not name -> tensor");
    state.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  return state;
}

void load_state_dict(torch::nn::Module& module, const StateDict& state) {
  StateDict own = state_dict(module);
  std::vector<std::string> missing, unexpected, mismatched;
  for (const auto& item : own) {
    const at::Tensor* given = state.find(item.key());
    if (given == nullptr) {
      missing.push_back(item.key());
    } else if (given->sizes() != item.value().sizes()) {
      mismatched.push_back(c10::str(item.key(), " (checkpoint ", given->sizes(), ", module ", item.value().sizes(), ")"));
    }
  }
  for (const auto& item : state) {
    if (!own.contains(item.key())) {
      unexpected.push_back(item.key());
    }
  }
  TORCH_CHECK(
      missing.empty() && unexpected.empty() && mismatched.empty(),
      "torchmha::load_state_dict: state dict does not fit the module. Missing: [", c10::Join(", ", missing),
      "]; unexpected: [", c10::Join(", ", unexpected), "]; shape mismatch: [", c10::Join(", ", mismatched), "]");
  torch::NoGradGuard no_grad;
  for (auto& item : own) {
    item.value().copy_(state[item.key()]);
  }
}

void load_state_dict(torch::nn::Module& module, const std::string& path) {
  load_state_dict(module, read_state_dict(path));
}

}  // namespace torchmha
