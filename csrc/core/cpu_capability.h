#pragma once

// Which copy of torchmha's CPU kernels' inner loops this CPU runs (each is built for AVX2/FMA and
// for AVX-512: decode_kernel.h, softmax_rows.h). ATen's own choice is the guide, so
// ATEN_CPU_CAPABILITY=avx2 also limits ours; on other CPUs the ATen composition runs instead.

#include <ATen/Version.h>

#include <string>

namespace torchmha::core {

enum class Capability { kNone, kAvx2, kAvx512 };

inline Capability cpu_capability() {
  static const Capability capability = [] {
    const std::string name = at::get_cpu_capability();
    return name == "AVX512" ? Capability::kAvx512 : name == "AVX2" ? Capability::kAvx2 : Capability::kNone;
  }();
  return capability;
}

}  // namespace torchmha::core
