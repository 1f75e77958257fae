// deploy.h's definitions: the static library TorchMHA::deploy (target torchmha_deploy), not
// libtorchmha, since they must work in a program that does not link libtorchmha. LibTorch only.

#include <torchmha/deploy.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/serialization/import.h>

#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

namespace torchmha {
namespace {

constexpr std::string_view kUnknownOp = "Unknown builtin op: ";

// The torchmha operator named in torch's "Unknown builtin op: torchmha::<name>" message, or
// nullopt when the message is about something else.
std::optional<std::string> missing_torchmha_operator(const std::string& message) {
  const auto at = message.find(std::string(kUnknownOp) + "torchmha::");
  if (at == std::string::npos) {
    return std::nullopt;
  }
  const auto begin = at + kUnknownOp.size();
  const auto end = message.find_first_of(".\n ", begin);
  return message.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// The line of `text` that holds position `at`.
std::string line_at(const std::string& text, std::size_t at) {
  const auto begin = text.rfind('\n', at);
  const auto from = begin == std::string::npos ? 0 : begin + 1;
  return text.substr(from, text.find('\n', at) - from);
}

}  // namespace

bool operators_loaded() {
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("torchmha::", 0) == 0) {
      return true;
    }
  }
  return false;
}

torch::jit::Module load_scripted_module(const std::string& path, std::optional<c10::Device> device) {
  try {
    return torch::jit::load(path, device);
  } catch (const std::exception& error) {
    const std::string original = error.what();
    const auto op = missing_torchmha_operator(original);
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
    message += "\ntorch::jit::load said: " + line_at(original, original.find(kUnknownOp));
    throw OperatorsNotLoaded(message);
  }
}

}  // namespace torchmha
