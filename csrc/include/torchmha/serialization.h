#pragma once

// Checkpoints that cross languages. A state dict here is what Python's `module.state_dict()` is:
// parameter and buffer names ("in_proj_weight", "out_proj.weight", "0.embedding.weight", ...)
// mapped to tensors. The file format is Python's `torch.save` format, so
//  - a file written by save_state_dict loads in Python with `torch.load(path)` and then
//    `torchmha.MultiheadAttention.load_state_dict` or `torch.nn.MultiheadAttention.load_state_dict`;
//  - a file written in Python by `torch.save(dict(module.state_dict()), path)` loads here with
//    load_state_dict. The dict() matters: state_dict() returns an OrderedDict carrying
//    _metadata, which LibTorch's unpickler cannot rebuild.
// torchmha's modules name their parameters as torch's Python modules do, so a C++ model and a
// Python model built from the same layers in the same order share their state dicts.
// (LibTorch's own torch::save(module, path) writes a TorchScript archive instead; Python reads it
// with torch.jit.load, see docs/cpp.md.)

#include <torchmha/export.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <string>

namespace torchmha {

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

/// Every parameter and buffer of `module` and its submodules, by dotted name, as Python's
/// state_dict() names them. The tensors are the module's own (not copies).
TORCHMHA_API StateDict state_dict(const torch::nn::Module& module);

/// Writes `state` (detached tensors) to `path` in torch.save's format; Python's torch.load(path)
/// returns it as a dict.
TORCHMHA_API void save_state_dict(const StateDict& state, const std::string& path);

/// save_state_dict(state_dict(module), path).
TORCHMHA_API void save_state_dict(const torch::nn::Module& module, const std::string& path);

/// Reads a dict of name -> tensor written by Python's torch.save (a plain dict, see above) or by
/// save_state_dict. Throws c10::Error if the file holds anything else.
TORCHMHA_API StateDict read_state_dict(const std::string& path);

/// Copies `state` into `module`'s parameters and buffers (without recording gradients, converting
/// dtype and device as Python's load_state_dict does). Strict, like Python's default: every name
/// must exist on both sides with the same shape, else c10::Error lists the missing, unexpected
/// or mismatched names and nothing is copied.
TORCHMHA_API void load_state_dict(torch::nn::Module& module, const StateDict& state);

/// read_state_dict(path) then load_state_dict(module, ...).
TORCHMHA_API void load_state_dict(torch::nn::Module& module, const std::string& path);

}  // namespace torchmha
