#pragma once

// Loading a TorchScript module saved by Python (torch.jit.save) whose code calls torchmha's
// operators (torch.ops.torchmha.*, e.g. a model with torchmha.MultiheadAttention or with
// torchmha.replace_multihead_attention applied). The operators are registered when libtorchmha is
// loaded; a program that does not link it gets torch's bare "Unknown builtin op: torchmha::..."
// from torch::jit::load. load_scripted_module turns that into an error that says what to link.
//
// Header-only on purpose: it must work in exactly the program that forgot to link the library,
// so it uses nothing but LibTorch. Not included by torchmha.h (it brings in TorchScript's headers):
//     #include <torchmha/deploy.h>
//
// AOTInductor packages (.pt2, torch._inductor.aoti_compile_and_package) and ONNX files need no
// torchmha at run time: torch.export decomposes the operators into aten operations.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/script.h>

#include <optional>
#include <stdexcept>
#include <string>

namespace torchmha {

/// Thrown by load_scripted_module when the module calls a torchmha operator this process does not
/// have. A std::runtime_error, like the std::exception torch::jit::load throws for it.
class OperatorsNotLoaded : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Whether libtorchmha is loaded in this process, i.e. torch.ops.torchmha.* are registered.
inline bool operators_loaded() {
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("torchmha::", 0) == 0) {
      return true;
    }
  }
  return false;
}

namespace detail {

// The torchmha operator named in torch's "Unknown builtin op: torchmha::<name>" message, or
// nullopt when the message is about something else.
inline std::optional<std::string> missing_torchmha_operator(const std::string& message) {
  static const std::string marker = "Unknown builtin op: ";
  const auto at = message.find(marker + "torchmha::");
  if (at == std::string::npos) {
    return std::nullopt;
  }
  const auto begin = at + marker.size();
  const auto end = message.find_first_of(".\n ", begin);
  return message.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// The line of `text` that holds position `at`.
inline std::string line_at(const std::string& text, size_t at) {
  const auto begin = text.rfind('\n', at);
  const auto from = begin == std::string::npos ? 0 : begin + 1;
  return text.substr(from, text.find('\n', at) - from);
}

}  // namespace detail

/// torch::jit::load(path, device), with a clear error when the module calls torchmha's operators
/// and libtorchmha is not loaded: OperatorsNotLoaded, whose message says what to link. Any other
/// failure is torch::jit::load's own exception, unchanged.
inline torch::jit::Module load_scripted_module(const std::string& path,
                                               std::optional<c10::Device> device = std::nullopt) {
  try {
    return torch::jit::load(path, device);
  } catch (const std::exception& error) {
    const auto op = detail::missing_torchmha_operator(error.what());
    if (!op) {
      throw;
    }
    std::string message = "torchmha: cannot load the TorchScript module '" + path + "': it calls " + *op + ", ";
    if (operators_loaded()) {
      // libtorchmha is loaded but lacks this operator: another torchmha version saved the module.
      message +=
          "which the loaded libtorchmha does not have: the module was saved with another version of "
          "torchmha (a newer one, most likely) than the one this program loads. Build the program against "
          "the torchmha that saved the module, or save the module again with this one.";
    } else {
      message +=
          "and torchmha's operators are not registered in this program because libtorchmha is not "
          "loaded.\nLink the program against torchmha; with CMake:\n"
          "    find_package(TorchMHA REQUIRED)\n"
          "    target_link_libraries(<your program> PRIVATE TorchMHA::torchmha)\n"
          "(TorchMHA::torchmha links with --no-as-needed, so the library is loaded even when the program "
          "calls none of its functions; linking by hand, put -Wl,--no-as-needed before -ltorchmha).";
    }
    const std::string original = error.what();
    message += "\ntorch::jit::load said: " + detail::line_at(original, original.find("Unknown builtin op: "));
    throw OperatorsNotLoaded(message);
  }
}

}  // namespace torchmha
