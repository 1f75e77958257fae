#pragma once

// Which copy of torchmha's CPU kernels' inner loops this CPU runs (each is built for AVX2/FMA and
// for AVX-512: decode_kernel.h, softmax_rows.h). ATen's own choice is the guide, so
// ATEN_CPU_CAPABILITY=avx2 also limits ours; on other CPUs the ATen composition runs instead.
// The settings below force each answer (docs/kernel_rules.md).

#include <ATen/Version.h>
#include <ATen/cpu/Utils.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "settings.h"

#include <string>

namespace torchmha::core {

enum class Capability { kNone, kAvx2, kAvx512 };

/// ATen's capability, or a lower one set by TORCHMHA_CPU_CAPABILITY (avx512, avx2, default), which
/// moves only torchmha's kernels (torch's ATEN_CPU_CAPABILITY moves ATen's too). A setting above
/// ATen's is an error: the copy would fault on a CPU without those instructions.
inline Capability cpu_capability() {
  static const Capability capability = [] {
    const std::string name = at::get_cpu_capability();
    const Capability aten = name == "AVX512" ? Capability::kAvx512 : name == "AVX2" ? Capability::kAvx2
                                                                                     : Capability::kNone;
    const auto set = settings::read_choice("TORCHMHA_CPU_CAPABILITY", {"avx512", "avx2", "default"});
    if (!set.has_value()) {
      return aten;
    }
    const Capability wanted = *set == "avx512" ? Capability::kAvx512 : *set == "avx2" ? Capability::kAvx2
                                                                                       : Capability::kNone;
    TORCH_CHECK_VALUE(wanted <= aten, "TORCHMHA_CPU_CAPABILITY=", *set, " is above ATen's capability on this CPU (",
                      name, "); it can only lower it");
    return wanted;
  }();
  return capability;
}

/// Whether torch's CPU feature table (at::cpu::get_cpu_capabilities, read once) says this CPU has
/// `feature`.
inline bool cpu_has_feature(const char* feature) {
  static const auto capabilities = at::cpu::get_cpu_capabilities();
  const auto found = capabilities.find(feature);
  return found != capabilities.end() && found->second.isBool() && found->second.toBool();
}

/// Whether this CPU has AMX tiles for `dtype` (bfloat16 or float16): ATen's own GEMMs and SDPA then
/// run on them. TORCHMHA_AMX=0/1 sets the answer for both dtypes (torchmha runs no AMX code itself,
/// so 1 is safe on any CPU: it only moves the rules that read this).
inline bool cpu_has_amx(at::ScalarType dtype) {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_AMX");
  static const bool bf16 = forced.value_or(cpu_has_feature("amx_bf16"));
  static const bool fp16 = forced.value_or(cpu_has_feature("amx_fp16"));
  return dtype == at::kBFloat16 ? bf16 : dtype == at::kHalf ? fp16 : false;
}

/// Whether this CPU computes float16 natively in AVX-512 (avx512_fp16): SDPA's float16 GEMMs then
/// run at that rate, and the blocked kernel (float16 computed in float32) keeps only training
/// there (blocked_attention.cpp). TORCHMHA_AVX512_FP16=0/1 sets the answer (torchmha runs no
/// AVX512-FP16 code itself, so 1 is safe on any CPU).
inline bool cpu_has_avx512_fp16() {
  static const bool fp16 =
      settings::read_switch("TORCHMHA_AVX512_FP16").value_or(cpu_has_feature("avx512_fp16"));
  return fp16;
}

/// Whether this is an AMD CPU: it has SSE4a, AMD's own extension (on every AMD x86-64 since 2007,
/// on no Intel CPU). The blocked kernel's float32 rule keys on it (blocked_attention.cpp): its
/// sizes were measured against SDPA on an AMD EPYC and on an Intel Xeon, and they differ there.
/// TORCHMHA_CPU_VENDOR=amd/intel sets the answer.
inline bool cpu_is_amd() {
  static const bool amd = [] {
    if (const auto set = settings::read_choice("TORCHMHA_CPU_VENDOR", {"amd", "intel"})) {
      return *set == "amd";
    }
    return cpu_has_feature("sse4a");
  }();
  return amd;
}

}  // namespace torchmha::core
