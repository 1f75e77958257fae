#pragma once

// Which copy of torchmha's CPU kernels' inner loops this CPU runs (each is built for AVX2/FMA and
// for AVX-512: decode_kernel.h, softmax_rows.h). ATen's own choice is the guide, so
// ATEN_CPU_CAPABILITY=avx2 also limits ours; on other CPUs the ATen composition runs instead.
// The settings below force each answer (docs/kernel_rules.md).

#include <ATen/Version.h>
#include <ATen/cpu/Utils.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "common/settings.h"

#include <cstring>
#include <optional>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace torchmha::cpu {

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
/// run on them. TORCHMHA_AMX=0/1 sets the answer for both dtypes (1 is safe on any CPU: it only
/// moves the rules that read this; torchmha's own AMX tiles, small_linear_kernel.cpp, read the
/// hardware's answer instead).
inline bool cpu_has_amx(at::ScalarType dtype) {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_AMX");
  static const bool bf16 = forced.value_or(cpu_has_feature("amx_bf16"));
  static const bool fp16 = forced.value_or(cpu_has_feature("amx_fp16"));
  return dtype == at::kBFloat16 ? bf16 : dtype == at::kHalf ? fp16 : false;
}

/// Whether this CPU computes float16 natively in AVX-512 (avx512_fp16): SDPA's float16 GEMMs then
/// run at that rate, and the blocked kernel (float16 computed in float32) keeps only training
/// there (blocked_attention_kernel.cpp). TORCHMHA_AVX512_FP16=0/1 sets the answer (torchmha runs no
/// AVX512-FP16 code itself, so 1 is safe on any CPU).
inline bool cpu_has_avx512_fp16() {
  static const bool fp16 =
      settings::read_switch("TORCHMHA_AVX512_FP16").value_or(cpu_has_feature("avx512_fp16"));
  return fp16;
}

/// Whether a bfloat16 or float16 GEMM (a linear layer's, on more rows than the small-batch kernel
/// takes) runs faster computed in float32 than by torch in its own dtype on this CPU. torch's
/// bfloat16 GEMMs run on oneDNN only with AVX-512 BW/VL/DQ (torch's mkldnn_bf16_device_check), its
/// float16 ones at speed only with AVX512-FP16 or AMX-FP16 (so TORCHMHA_AVX512_FP16 and
/// TORCHMHA_AMX move the float16 answer too); elsewhere they run 3-8x below float32
/// (docs/kernel_rules.md). TORCHMHA_FLOAT32_GEMM=0/1 sets the answer for both dtypes.
inline bool reduced_gemm_in_float32(at::ScalarType dtype) {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_FLOAT32_GEMM");
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    return false;
  }
  if (forced.has_value()) {
    return *forced;
  }
  static const bool bf16 = !(cpu_has_feature("avx512_bw") && cpu_has_feature("avx512_vl") &&
                             cpu_has_feature("avx512_dq"));
  static const bool fp16 = !(cpu_has_avx512_fp16() || cpu_has_amx(at::kHalf));
  return dtype == at::kBFloat16 ? bf16 : fp16;
}

struct CpuidLeaf {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
};

/// CPUID's registers for `leaf`, or nothing where the CPU is not x86 or lacks the leaf.
inline std::optional<CpuidLeaf> cpuid(unsigned int leaf) {
#if defined(__x86_64__) || defined(__i386__)
  CpuidLeaf out;
  if (__get_cpuid(leaf, &out.eax, &out.ebx, &out.ecx, &out.edx)) {
    return out;
  }
#endif
  (void)leaf;
  return std::nullopt;
}

enum class Vendor { kIntel, kAmd, kHygon, kOther };

/// The CPU's vendor, from CPUID's vendor string ("GenuineIntel", "AuthenticAMD", "HygonGenuine"),
/// read once. Hygon's x86 CPUs are AMD Zen cores made under licence, with AMD's extensions
/// (SSE4a), so a feature test would count them as AMD: they are named as themselves, and each
/// rule says what it does for them. The blocked kernel's float32 rule keys on it
/// (blocked_attention_kernel.cpp): its sizes were measured on an AMD EPYC and on an Intel Xeon,
/// and they differ there. TORCHMHA_CPU_VENDOR=intel/amd/hygon/other sets the answer.
inline Vendor cpu_vendor() {
  static const Vendor vendor = [] {
    if (const auto set = settings::read_choice("TORCHMHA_CPU_VENDOR", {"intel", "amd", "hygon", "other"})) {
      return *set == "intel" ? Vendor::kIntel : *set == "amd" ? Vendor::kAmd : *set == "hygon" ? Vendor::kHygon
                                                                                                : Vendor::kOther;
    }
    const auto leaf = cpuid(0);
    if (!leaf.has_value()) {
      return Vendor::kOther;
    }
    char name[13] = {};
    std::memcpy(name, &leaf->ebx, 4);
    std::memcpy(name + 4, &leaf->edx, 4);
    std::memcpy(name + 8, &leaf->ecx, 4);
    const std::string id(name);
    return id == "GenuineIntel" ? Vendor::kIntel : id == "AuthenticAMD" ? Vendor::kAmd
                                                 : id == "HygonGenuine" ? Vendor::kHygon
                                                                        : Vendor::kOther;
  }();
  return vendor;
}

/// Whether this CPU runs the AVX-512 copy's 512-bit instructions as two 256-bit halves: AMD's Zen 4
/// (family 0x19 with AVX-512; Zen 3, the same family, has none; Zen 5, 0x1A, runs them whole).
/// There a 512-bit VNNI or bfloat16 dot product costs as much as two of the float loop's FMAs, and
/// the rules that chose them on Zen 5 lose, as do the float blocks past 64 rows against MKL's GEMM
/// (small_linear_kernel.cpp). TORCHMHA_AVX512_HALVES=0/1
/// sets the answer (either is safe anywhere: it only moves those rules).
inline bool cpu_splits_avx512() {
  static const bool split = [] {
    if (const auto set = settings::read_switch("TORCHMHA_AVX512_HALVES")) {
      return *set;
    }
    unsigned int family = 0;
    if (const auto leaf = cpuid(1)) {
      family = (leaf->eax >> 8) & 0xF;
      family += family == 0xF ? (leaf->eax >> 20) & 0xFF : 0;  // CPUID's extended family
    }
    return cpu_vendor() == Vendor::kAmd && family == 0x19 && cpu_capability() == Capability::kAvx512;
  }();
  return split;
}

}  // namespace torchmha::cpu
