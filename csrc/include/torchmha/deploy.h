#pragma once

// Loading a TorchScript module saved by Python (torch.jit.save) whose code calls torchmha's
// operators (torch.ops.torchmha.*, e.g. a model with torchmha.MultiheadAttention or with
// torchmha.replace_multihead_attention applied). The operators are registered when libtorchmha is
// loaded; a program that does not link it gets torch's bare "Unknown builtin op: torchmha::..."
// from torch::jit::load. load_scripted_module turns that into an error that says what to link.
//
// Not part of libtorchmha, on purpose: it must work in exactly the program that forgot to link
// the library. Its definitions (csrc/deploy.cpp) are in a small static library that needs nothing
// but LibTorch, the CMake target TorchMHA::deploy; TorchMHA::torchmha brings it, and a program
// that wants only this header links TorchMHA::deploy alone. Hence no TORCHMHA_API here. Not
// included by torchmha.h (it brings in TorchScript's headers):
//     #include <torchmha/deploy.h>
//
// AOTInductor packages (.pt2, torch._inductor.aoti_compile_and_package) and ONNX files need no
// torchmha at run time: torch.export decomposes the operators into aten operations.

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
bool operators_loaded();

/// torch::jit::load(path, device), with a clear error when the module calls torchmha's operators
/// that this process does not have: OperatorsNotLoaded, whose message names the operator and says
/// what to link (libtorchmha is not loaded) or that the module was saved by another torchmha
/// version (it is loaded but lacks the operator). Any other failure is torch::jit::load's own
/// exception, unchanged.
torch::jit::Module load_scripted_module(const std::string& path, std::optional<c10::Device> device = std::nullopt);

}  // namespace torchmha
