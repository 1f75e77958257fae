#pragma once

// Which copy of torchmha's CPU kernels' inner loops this CPU runs (each is built for AVX2/FMA and
// for AVX-512: decode_kernel.h, softmax_rows.h). ATen's own choice is the guide, so
// ATEN_CPU_CAPABILITY=avx2 also limits ours; on other CPUs the ATen composition runs instead.

#include <ATen/Version.h>
#include <ATen/cpu/Utils.h>
#include <c10/core/ScalarType.h>

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

/// Whether this CPU has AMX tiles for `dtype` (bfloat16 or float16): ATen's own GEMMs and SDPA then
/// run on them.
inline bool cpu_has_amx(at::ScalarType dtype) {
  static const auto capabilities = at::cpu::get_cpu_capabilities();
  const auto has = [](const char* key) {
    const auto found = capabilities.find(key);
    return found != capabilities.end() && found->second.isBool() && found->second.toBool();
  };
  static const bool bf16 = has("amx_bf16"), fp16 = has("amx_fp16");
  return dtype == at::kBFloat16 ? bf16 : dtype == at::kHalf ? fp16 : false;
}

}  // namespace torchmha::core
