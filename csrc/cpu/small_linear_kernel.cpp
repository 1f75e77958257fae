// torchmha's CPU kernel of the linear layers of a decoding step: each weight row read once, front
// to back, at the read rate (kernels.h; the op's front is csrc/core/small_linear.cpp).

#include "cpu/kernels.h"

#include "common/settings.h"
#include "cpu/cpu_capability.h"
#include "cpu/vec/linear_kernel.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>
#include <type_traits>

namespace torchmha::cpu {
namespace {

bool enabled() {
  static const bool on = settings::read_switch("TORCHMHA_SMALL_LINEAR").value_or(true);
  return on;
}

// Shapes, dtypes and strides the kernel reads through raw pointers: W in x's dtype, or int8 with a
// float32 scale per row.
bool kernel_applies(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias) {
  const auto dtype = x.scalar_type();
  const auto weight_dtype = is_present(scale) ? at::kChar : dtype;
  if (!enabled() || cpu_capability() == Capability::kNone || !x.device().is_cpu() || !weight.device().is_cpu() ||
      (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) || weight.scalar_type() != weight_dtype ||
      x.dim() < 1 || weight.dim() != 2 || x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      weight.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const int64_t K = x.size(-1);
  const int64_t rows = K > 0 ? x.numel() / K : 0;
  const auto per_row = [&](const Tensor& t, at::ScalarType type) {
    return t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.size(0) == weight.size(0) &&
        t.stride(0) == 1;
  };
  return K > 0 && weight.size(1) == K && weight.size(0) > 0 && rows >= 1 && rows <= kernel::kLinearMaxRows &&
      weight.stride(1) == 1 && weight.stride(0) >= K && (!is_present(scale) || per_row(*scale, at::kFloat)) &&
      (!is_present(bias) || per_row(*bias, dtype));
}

// torchmha's AMX tiles (linear_kernel_amx.cpp): the hardware, and the tile state, which Linux
// grants a process on request (at::cpu::init_amx, asked once; oneDNN asks the same). That file is
// built for AVX512-BF16 too, so every tile path needs it. TORCHMHA_AMX_LINEAR=0 never takes them,
// 1 from 1 row (the hardware is needed either way; TORCHMHA_AMX does not move this: it is the
// rules' view of ATen's AMX).
std::optional<bool> amx_setting() {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_AMX_LINEAR");
  return forced;
}
enum class Tiles { kBFloat16, kInt8 };
bool tiles_usable(Tiles tiles) {
  static const bool granted = amx_setting().value_or(true) && cpu_capability() == Capability::kAvx512 &&
      cpu_has_feature("avx512_bf16") && at::cpu::init_amx();
  static const bool bf16 = granted && cpu_has_feature("amx_bf16");
  static const bool int8 = granted && cpu_has_feature("amx_int8") && at::cpu::is_avx512_vnni_supported();
  return tiles == Tiles::kBFloat16 ? bf16 : int8;
}
// From how many rows of x a tile path takes a call: its measured count, or 1 under TORCHMHA_AMX_LINEAR=1.
int64_t tile_min_rows(int64_t measured) {
  return amx_setting().value_or(false) ? 1 : measured;
}

// Rows of x up to which the kernel takes a call in blocks of kLinearMaxRows (a pass over the weights
// each) rather than leaving it to a GEMM (docs/kernel_rules.md). Measured on each kind with AVX-512
// (2 threads, alternated in one process, a decoding step's 36 weights, 512x512 to 2048x512, against
// dequantizing for a GEMM for int8 and ATen's GEMM for float weights):
// - AMD (Zen 5), where MKL's float32 GEMM reaches about 40% of the FMA peak: int8 202-225 GFLOP/s
//   from 16 to 1024 rows against 88-195; float32 198-261 against 165-203 from 128 to 1024 rows,
//   float16 249-258 against 175-186. Past 16 MiB only 64 rows: each block reads the weight again,
//   cheap only while it stays in L3 (32 MiB there; 4096x4096 lost 0.78-0.87x at 256-1024 rows).
// - Intel (Xeon with AMX), where MKL's reaches 440 GFLOP/s at 2048^3: float32 183-206 against
//   108-171 at 16-32 rows, 209 against 278 at 64; past 16 MiB (4096x4096, 8192x2048) 0.81-0.84 of
//   the GEMM's time at 16 rows, 1.19-1.23 at 32. float16 (native GEMMs with AVX512-FP16) 1.03-1.11
//   at 16 rows one matrix at a time: no blocks. int8 with float32 x 201-213 against 32-153 at 16-64
//   rows, 208 against 216 at 128.
// Weights under 2^18 elements lost on AMD (768x256 0.73x at 64 rows: the blocks' calls cost more
// than the GEMM). bfloat16 x keeps 32 int8 rows and no float blocks: its GEMM (oneDNN on
// AVX512-BF16 or AMX) overtook the blocks between 32 and 64 rows on AMD (549 against 326 GFLOP/s at
// 128) and from 16 rows on Intel (290 against 169). The AVX2 copy on AMD (EPYC Zen 3, no AVX-512;
// the same 36 weights, 2 threads, alternated processes, 3 rounds), where MKL's GEMM of a few rows
// is slow, with the blocks taking each chunk of features through every block (float_loop): blocks
// took of the GEMM's time, float32 0.64-0.82 at 64 rows, 0.74-0.93 at 96, 0.80-1.06 at 128,
// 0.94-1.06 at 192; float16 0.55-0.76 at 64, 0.69-0.94 at 128, 0.84-1.05 at 192; bfloat16 (its GEMM
// in float32 copies) 0.38-0.74 at 64, 0.58-1.07 at 128; int8 weights with float32 x 0.52-0.61 at
// 128, 0.86-1.11 at 256, with bfloat16 x 0.33-0.51 at 64, 0.57-0.73 at 128. (A block at a time,
// before, float32 lost from 48 rows.) Other CPUs (AVX2, other vendors): 32 int8 rows, no float
// blocks, not measured. With AMX tiles (bfloat16 x and weights, K
// a multiple of 32): 16 rows for weights of 256 KiB to 2 MiB (Intel Xeon with AMX: 0.59-0.74 of
// F.linear's time at 9-16 rows; 8-32 MiB weights 1.13-1.29, as each block re-reads them past L2;
// 128 KiB 1.03 at 16). Zen 4 (AVX-512 in halves, cpu_splits_avx512; 2026-12-06, the 36 weights,
// alternated processes, 5-7 rounds), blocks over the GEMM's time: float32 0.60 at 16 rows,
// 0.71-0.79 at 32-64, 0.67-1.04 at 80-104 (the GEMM's own time jumped between runs there), 0.98-1.15
// at 128-512, 1.09-1.14 at 1024; float16 0.19 at 16, 0.50 at 64, 0.77 and 1.10 at 128 (two runs),
// 1.12-1.30 at 160-1024; int8 with float32 x 0.36 at 64, 0.81-0.83 at 256-1024 (kept at 1024). So 64 rows there.
// TORCHMHA_LINEAR_BLOCKED_ROWS=R sets the limit for every weight.
int64_t blocked_rows(const Tensor& x, const Tensor& weight, bool quantized) {
  static const std::optional<int64_t> forced = settings::read_count("TORCHMHA_LINEAR_BLOCKED_ROWS", "rows of x");
  if (forced.has_value()) {
    return *forced;
  }
  const int64_t bytes = weight.numel() * static_cast<int64_t>(weight.element_size());
  if (!quantized && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
      x.size(-1) % 32 == 0 && weight.size(0) >= 16 && bytes >= (int64_t(256) << 10) && bytes <= (int64_t(2) << 20) &&
      tiles_usable(Tiles::kBFloat16)) {
    return 16;
  }
  if (cpu_capability() == Capability::kAvx2 && cpu_vendor() == Vendor::kAmd) {
    return !quantized && weight.numel() < (int64_t(1) << 18) ? 0 : 128;
  }
  const Vendor vendor = cpu_capability() == Capability::kAvx512 ? cpu_vendor() : Vendor::kOther;
  const bool measured = vendor == Vendor::kAmd || vendor == Vendor::kIntel;
  if (!measured || x.scalar_type() == at::kBFloat16) {
    return quantized ? 32 : 0;
  }
  if (quantized) {
    return vendor == Vendor::kAmd ? 1024 : 64;
  }
  if (weight.numel() < (int64_t(1) << 18) || (vendor == Vendor::kIntel && x.scalar_type() == at::kHalf)) {
    return 0;
  }
  const bool over_16_mib = weight.numel() * static_cast<int64_t>(weight.element_size()) > (int64_t(16) << 20);
  if (vendor == Vendor::kIntel) {
    return over_16_mib ? 16 : 32;
  }
  return over_16_mib || cpu_splits_avx512() ? 64 : 1024;
}

// Tasks of at least 64 KiB of weights: below that, waking a thread costs more than it saves.
int64_t grain_of(int64_t K, int64_t element_size) {
  return std::max<int64_t>(8, 65536 / (K * element_size));
}

// fn(begin, end) over blocks [begin, end) of 16 output features (a tile's), split over threads as
// grain_of splits features; returns the features covered, O rounded down to 16.
template <typename Fn>
int64_t for_each_tile_block(int64_t O, int64_t K, int64_t element_size, const Fn& fn) {
  at::parallel_for(0, O / 16, std::max<int64_t>(1, grain_of(K, element_size) / 16), fn);
  return O / 16 * 16;
}

// int8 weights through AVX512-VNNI's integer dot products (linear_kernel_vnni.cpp), for up to
// kIntegerMaxRows rows, on AMD's Zen 5: there they beat the float conversion (docs/kernel_rules.md);
// on the Intel Xeon with AMX they lost (0.72-0.96x at 2-4 rows, even at 1), and on Zen 4, which runs
// them as two halves (cpu_splits_avx512), the float loop took 0.87, 0.65, 0.55 and 0.56 of their
// time at 1-4 rows. TORCHMHA_VNNI=1 takes them on any CPU with VNNI, 0 never.
bool integer_kernel_applies(int64_t M, int64_t K) {
  static const bool on =
      settings::read_switch("TORCHMHA_VNNI").value_or(cpu_vendor() == Vendor::kAmd && !cpu_splits_avx512()) &&
      cpu_capability() == Capability::kAvx512 && at::cpu::is_avx512_vnni_supported();
  return on && M <= kernel::kIntegerMaxRows && K <= kernel::kIntegerMaxK;
}

// The VNNI kernel on rows [first, first + count) of x's digits: it takes at most kIntegerMaxRows.
void vnni_rows(const kernel::IntegerProblem& all, int64_t first, int64_t count, int64_t begin, int64_t end) {
  kernel::IntegerProblem p = all;
  p.x.digits += first * kernel::kDigits * p.x.padded_k;
  p.x.steps += first;
  p.x.sums += first;
  p.y += first * p.O;
  p.M = count;
  kernel::avx512_vnni::quantized_rows(p, begin, end);
}

// x's rows (M, K) in float32, as the float and integer loops read them: x's own data where it is
// float32 and contiguous (no op: a decoding step makes 36 such calls, where each op costs about
// as much as a small weight's read), else a converted copy, held in `converted` or `copy`.
struct FloatRows {
  Tensor copy;
  std::unique_ptr<float[]> converted;
  const float* data;
  int64_t M, K;
};
FloatRows float_rows(const Tensor& x) {
  const int64_t K = x.size(-1), M = x.numel() / K;
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) {
    return {Tensor(), nullptr, x.const_data_ptr<float>(), M, K};
  }
  // Contiguous bfloat16 and float16 rows converted here, exactly, with the instruction set's
  // conversions (this file is built for the baseline CPU), not by x.to(float): its 30 ATen calls a
  // step made a 6-layer d_model 64 bfloat16 step 244-266 us against 161 in float32, 170-174 with
  // this (AMD EPYC Zen 3).
  if ((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && x.is_contiguous()) {
    std::unique_ptr<float[]> converted(new float[M * K]);
    const auto convert = [&](const auto* values) {
      cpu_capability() == Capability::kAvx512 ? kernel::avx512::to_float(values, M * K, converted.get())
                                              : kernel::avx2::to_float(values, M * K, converted.get());
    };
    x.scalar_type() == at::kBFloat16 ? convert(x.const_data_ptr<c10::BFloat16>())
                                     : convert(x.const_data_ptr<c10::Half>());
    const float* data = converted.get();
    return {Tensor(), std::move(converted), data, M, K};
  }
  Tensor copy = x.reshape({M, K}).to(at::kFloat).contiguous();
  return {copy, nullptr, copy.const_data_ptr<float>(), M, K};
}

// fn(out, bias): the integer kernels' float32 sums into `out` with a float32 bias (or null); y
// of another dtype gets them through a float32 buffer, and a bias of another dtype through a copy.
template <typename Fn>
void into_float(const Tensor& y, const OptionalTensor& bias, const Fn& fn) {
  const bool in_float = y.scalar_type() == at::kFloat;
  const Tensor out = in_float ? y : at::empty(y.sizes(), y.options().dtype(at::kFloat));
  const bool float_bias = is_present(bias) && bias->scalar_type() == at::kFloat;
  const Tensor bias_copy = is_present(bias) && !float_bias ? bias->to(at::kFloat) : Tensor();
  fn(out.data_ptr<float>(), float_bias ? bias->const_data_ptr<float>()
                                        : bias_copy.defined() ? bias_copy.const_data_ptr<float>() : nullptr);
  if (!in_float) {
    y.copy_(out);
  }
}

// x as integer digits against int8 weights: on the tiles (blocks of 16 features; the rest, and
// everything without tiles, on VNNI, 4 rows at a time). False, with nothing written, where x holds
// an inf or a NaN (the float kernel then runs).
bool run_integer_kernel(const FloatRows& rows, const Tensor& weight, const Tensor& scale, const OptionalTensor& bias,
                        const Tensor& y, bool tiles) {
  const int64_t M = rows.M, K = rows.K, O = weight.size(0);
  const int64_t padded_k = (K + 63) / 64 * 64;
  const std::unique_ptr<int8_t[]> digits(new int8_t[M * kernel::kDigits * padded_k]);  // (integer_rows fills it)
  std::array<double, kernel::kLinearMaxRows> steps{};
  std::array<int64_t, kernel::kLinearMaxRows> sums{};
  kernel::IntegerRows x{digits.get(), padded_k, steps.data(), sums.data()};
  if (!kernel::avx512_vnni::integer_rows(rows.data, M, K, x)) {
    return false;
  }
  into_float(y, bias, [&](float* out, const float* float_bias) {
    const kernel::IntegerProblem problem{x, weight.data_ptr<int8_t>(), weight.stride(0), scale.data_ptr<float>(),
                                         float_bias, out, M, K, O};
    int64_t done = 0;
    if (tiles) {
      const std::unique_ptr<uint32_t[]> packed(new uint32_t[padded_k * M]);  // (not zeroed: all written)
      kernel::amx::pack_digits(x, M, packed.get());
      done = for_each_tile_block(O, K, 1, [&](int64_t begin, int64_t end) {
        kernel::amx::integer_tiles(problem, packed.get(), begin, end);
      });
    }
    at::parallel_for(done, O, grain_of(K, 1), [&](int64_t begin, int64_t end) {
      for (int64_t first = 0; first < M; first += kernel::kIntegerMaxRows) {
        vnni_rows(problem, first, std::min(kernel::kIntegerMaxRows, M - first), begin, end);
      }
    });
  });
  return true;
}

// int8 weights at one row of x through 16-bit integer digits (linear_kernel_int16.cpp), rather
// than the float loop, where torchmha's AVX2 copy runs (no VNNI there). AMD EPYC Zen 3, weight_reads'
// 36 matrices at one row, 2 threads: 1.16-1.21x faster (alternated processes, 3 rounds; 1.04-1.10x
// in one process before the accumulators were summed in int32), one feature a pass; four a pass
// since, 1.11-1.17x faster again. Not measured against the AVX-512 copy's four-features loop
// (0.90-0.96 of the read rate on the Intel Xeon with AMX) or VNNI. Any K: the digits' int32 sums
// are widened every 4096 columns.
// TORCHMHA_INT16_DIGITS=1 takes them wherever an AVX2 or AVX-512 copy runs and VNNI does not take
// the row, 0 never.
bool int16_kernel_applies(int64_t M) {
  static const bool on = settings::read_switch("TORCHMHA_INT16_DIGITS").value_or(cpu_capability() == Capability::kAvx2) &&
      cpu_capability() != Capability::kNone;
  return on && M == 1;
}

// One row of x as 16-bit digits against int8 weights. False, with nothing written, where x holds
// an inf or a NaN, or is all below 2^-98 (the float kernel then runs).
bool run_int16_kernel(const FloatRows& row, const Tensor& weight, const Tensor& scale, const OptionalTensor& bias,
                      const Tensor& y) {
  const int64_t K = row.K, O = weight.size(0);
  const int64_t padded_k = (K + 15) / 16 * 16;
  const std::unique_ptr<int16_t[]> digits(new int16_t[2 * padded_k]);  // (int16_row fills it)
  kernel::Int16Rows x{digits.get(), padded_k, 0.0};
  if (!kernel::avx2_int16::int16_row(row.data, K, x)) {
    return false;
  }
  into_float(y, bias, [&](float* out, const float* float_bias) {
    const kernel::Int16Problem problem{x, weight.data_ptr<int8_t>(), weight.stride(0), scale.data_ptr<float>(),
                                       float_bias, out, K, O};
    at::parallel_for(0, O, grain_of(K, 1), [&](int64_t begin, int64_t end) {
      kernel::avx2_int16::quantized_row(problem, begin, end);
    });
  });
  return true;
}

// bfloat16 x through AVX512-BF16's dot products (linear_kernel_bf16.cpp) rather than the float
// loop: against bfloat16 weights on every CPU with them (from 3 rows where the CPU splits AVX-512
// in halves: on Zen 4 the float loop took 0.77 and 0.84 of their time at 1 and 2 rows, 1.00 at 3,
// 1.18 at 4), against int8 weights (5-8 rows) on AMD only, where they won (Zen 4 too: the float
// loop 1.58-1.63x their time); on the Intel Xeon with AMX the float loop was 1.28-1.37x faster
// there (docs/kernel_rules.md). TORCHMHA_AVX512_BF16=1 takes them for both at any rows, 0 for neither.
bool bfloat16_kernel_applies(bool int8_weights, int64_t M) {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_AVX512_BF16");
  static const bool has = cpu_capability() == Capability::kAvx512 && cpu_has_feature("avx512_bf16");
  const bool measured_win = int8_weights ? cpu_vendor() == Vendor::kAmd : M >= 3 || !cpu_splits_avx512();
  return has && forced.value_or(measured_win);
}

// Output features a pass of the dot products (linear_kernel_bf16.cpp): two, each vector of x loaded
// once for both, for int8 weights from 6 rows where AVX-512 runs in halves (Zen 4), whose loads of
// x bound those rows; else one. Zen 4, weight_reads' 36 matrices, bfloat16 x, alternated processes
// (5 rounds, two runs), two over one's time: int8 weights 0.78 and 0.74 at 8 rows, 0.83 at 6,
// 0.90-1.01 at 5, 0.94-0.97 at 3-4, 1.13 at 1; bfloat16 weights 1.11-1.46 at 3-8 rows (two rows
// streamed at once read slower), though 0.72-0.83 with the weights in cache (docs/kernel_rules.md).
int bfloat16_features_a_pass(bool int8_weights, int64_t M) {
  return int8_weights && M >= 6 && cpu_splits_avx512() ? 2 : 1;
}

// Whether the float loop and the bfloat16 dot products prefetch the rows ahead as one block, front
// to back, where a pass takes several features of contiguous rows (prefetch_offset, linear_kernel.h),
// rather than at column k of each row. Measured (docs/kernel_rules.md, the prefetches' order) on the
// AVX2 copy (Zen 3) and where AVX-512 runs in halves (Zen 4: weight_reads' 36 matrices, alternated
// processes, 5-9 rounds, in order over each row's order, time: int8 1 row 0.85-0.87, the int8 step
// at batch 1 0.83; float32 8 rows 0.89, float16 6-8 0.83-0.93, int8 3-8 0.95-1.00, int8 under the
// dot products at 6-8 rows 0.97-0.98; float32 3-5 rows 0.97-1.06, in the noise). Zen 5 and Intel
// keep each row's order, unmeasured. TORCHMHA_PREFETCH_ORDER=1 takes it on every copy, 0 never.
bool prefetch_in_order() {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_PREFETCH_ORDER");
  return forced.value_or(cpu_capability() != Capability::kAvx512 || cpu_splits_avx512());
}

// bfloat16 weights on the tiles rather than the dot products from kAmxMinRows rows of x: there the
// dot products are bound by their instructions, the tiles by the read (docs/kernel_rules.md). K a
// multiple of 32 (a tile's columns); the output features past the last 16 run on the dot products.
constexpr int64_t kAmxMinRows = 3;
bool amx_kernel_applies(int64_t M, int64_t K, int64_t O) {
  return M >= tile_min_rows(kAmxMinRows) && K % 32 == 0 && O >= 16 && tiles_usable(Tiles::kBFloat16);
}

// float16 weights on the tiles (each value split into two bfloat16 halves) rather than the float
// loop, from kHalfTilesMinRows rows (docs/kernel_rules.md). K a multiple of 32; the features past the
// last 16 run on the float loop.
constexpr int64_t kHalfTilesMinRows = 5;
bool half_tiles_apply(int64_t M, int64_t K, int64_t O) {
  return M >= tile_min_rows(kHalfTilesMinRows) && K % 32 == 0 && O >= 16 && tiles_usable(Tiles::kBFloat16);
}

// float16 x and weights on the tiles, for output features [0, 16 (O / 16)); returns that end.
int64_t run_float16_tiles(const Tensor& x, const Tensor& weight, const OptionalTensor& bias, const Tensor& y) {
  const int64_t K = x.size(-1), O = weight.size(0);
  const Tensor rows = x.reshape({-1, K}).contiguous();
  const auto bits = [](const Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::Half>()); };
  const kernel::BFloat16Problem<uint16_t> problem{
      bits(rows), reinterpret_cast<const uint16_t*>(weight.const_data_ptr()), weight.stride(0), nullptr,
      is_present(bias) ? bits(*bias) : nullptr, bits(y), rows.size(0), K, O};
  const int64_t M = problem.M;
  const std::unique_ptr<uint16_t[]> halves(new uint16_t[2 * M * K]);
  const std::unique_ptr<uint32_t[]> packed(new uint32_t[K * M]);  // (not zeroed: all written)
  kernel::amx::pack_halves(problem.x, M, K, halves.get(), packed.get());
  return for_each_tile_block(O, K, 2, [&](int64_t begin, int64_t end) {
    kernel::amx::float16_tiles(problem, packed.get(), begin, end);
  });
}

// int8 weights on the tiles against x's integer digits (the VNNI kernel's, with the same results)
// from kIntegerTilesMinRows rows, rather than VNNI or the float loop (docs/kernel_rules.md). K a
// multiple of 64, at most kIntegerTilesMaxK; the features past the last 16 go to VNNI.
constexpr int64_t kIntegerTilesMinRows = 2;
bool integer_tiles_apply(int64_t M, int64_t K, int64_t O) {
  return M >= tile_min_rows(kIntegerTilesMinRows) && K % 64 == 0 && K <= kernel::amx::kIntegerTilesMaxK && O >= 16 &&
      tiles_usable(Tiles::kInt8);
}

// (tiles: bfloat16 weights where amx_kernel_applies)
template <typename weight_t>
void run_bfloat16_kernel(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias,
                         const Tensor& y, bool tiles = false) {
  const int64_t K = x.size(-1), O = weight.size(0);
  const Tensor rows = x.reshape({-1, K}).contiguous();
  const auto bits = [](const Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); };
  const kernel::BFloat16Problem<weight_t> problem{
      bits(rows), reinterpret_cast<const weight_t*>(weight.const_data_ptr()), weight.stride(0),
      is_present(scale) ? scale->const_data_ptr<float>() : nullptr, is_present(bias) ? bits(*bias) : nullptr, bits(y),
      rows.size(0), K, O, bfloat16_features_a_pass(std::is_same_v<weight_t, int8_t>, rows.size(0)),
      prefetch_in_order()};
  int64_t done = 0;
  if constexpr (std::is_same_v<weight_t, uint16_t>) {
    if (tiles) {
      const std::unique_ptr<uint32_t[]> packed(new uint32_t[K * problem.M / 2]);  // (not zeroed: all written)
      kernel::amx::pack_rows(problem.x, problem.M, K, packed.get());
      done = for_each_tile_block(O, K, 2, [&](int64_t begin, int64_t end) {
        kernel::amx::bfloat16_tiles(problem, packed.get(), begin, end);
      });
    }
  }
  at::parallel_for(done, O, grain_of(K, sizeof(weight_t)), [&](int64_t begin, int64_t end) {
    kernel::avx512_bf16::bfloat16_rows(problem, begin, end);
  });
}

// Whether sum_k |W[o, k] x[m, k]| may pass float's range with int8 weights (|W| <= 128) before the
// scale brings it back: then the dequantizing reference runs (it scales the weights first).
bool int8_sums_may_overflow(const FloatRows& rows) {
  const float* x = rows.data;
  const int64_t n = rows.M * rows.K;
  // (eight running maxima: one chain of dependent maxss cost 13 us of a 110 us 8 x 2048 call)
  std::array<float, 8> lanes{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] = std::max(lanes[j], std::abs(x[i + j]));
  }
  for (; i < n; ++i) lanes[0] = std::max(lanes[0], std::abs(x[i]));
  const float largest = *std::max_element(lanes.begin(), lanes.end());
  return !(largest * 128.0f * static_cast<float>(rows.K) < std::numeric_limits<float>::max()) &&
      std::isfinite(largest);
}

// Output features a thread takes through every block of rows before its next ones: 64 features of
// 512 float32 weights are 128 KiB, in L2. AMD EPYC Zen 3, weight_reads' 36 matrices at 16 and 64
// rows: 32-128 within 5% of each other, 16 and 256 up to 10% slower.
constexpr int64_t kFeatureChunk = 64;

// Rows [row, row + kLinearMaxRows) of p (fewer at the end).
template <typename scalar_t, typename weight_t>
kernel::LinearProblem<scalar_t, weight_t> rows_block(kernel::LinearProblem<scalar_t, weight_t> p, int64_t row) {
  p.x += row * p.K;
  p.y += row * p.O;
  p.M = std::min(kernel::kLinearMaxRows, p.M - row);
  return p;
}

// Output features [begin, end) of p for each block of its rows.
template <typename scalar_t, typename weight_t>
void each_block(const kernel::LinearProblem<scalar_t, weight_t>& p, int64_t begin, int64_t end) {
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  for (int64_t row = 0; row < p.M; row += kernel::kLinearMaxRows) {
    const auto block = rows_block(p, row);
    avx512 ? kernel::avx512::linear_rows(block, begin, end) : kernel::avx2::linear_rows(block, begin, end);
  }
}

// Whether the float loop prefetches the weights into L2 only rather than L1 (linear_kernel_impl.h).
// On Zen 4 (cpu_splits_avx512; weight_reads' 36 matrices, 2 threads, alternated processes, 5-9
// rounds, medians of the L2 hint's time over L1's, two or three runs): float32 weights 0.81-0.94 at
// 1 row, 0.74-0.76 at 2, 0.66-0.70 at 3-4, 0.57 at 5, 0.63-0.64 at 8, and its blocks of 8 rows 0.53
// against 0.60 of the GEMM's time at 16 rows, 0.85 against 0.91 at 64; bfloat16 weights (the float
// loop at 1-2 rows there) 0.84-1.03 at 1, 0.76-0.96 at 2. int8 weights measured 0.97-1.07 and
// float16 0.77-1.13, varying with the rows (the conversions bound them, not the loads), and the
// bfloat16 dot products' own prefetch 0.86-1.15: those keep L1. Other CPUs keep L1 (Zen 5's hint
// was measured against none, not against L2). TORCHMHA_PREFETCH_L2=1 takes L2 for every weight
// dtype on the AVX-512 copy, 0 never.
template <typename weight_t>
bool weights_to_l2() {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_PREFETCH_L2");
  constexpr bool measured = std::is_same_v<weight_t, float> || std::is_same_v<weight_t, c10::BFloat16>;
  return forced.value_or(measured && cpu_splits_avx512());
}

// Whether the float loop takes float16 weights two output features a pass from 6 rows (each vector
// of x loaded once for both; linear_kernel_impl.h), rather than one. Where AVX-512 runs in halves
// (Zen 4), whose 8 rows of float16 are bound by their arithmetic and x's loads, not the read:
// weight_reads' 36 matrices, alternated processes, 4 rounds, two over one's time: 0.80 at 8 rows
// (rounds 0.79-0.82), 0.93-0.96 at 6, but 1.02-1.07 at 5 (0.74-0.87 in cache). Not measured elsewhere
// (Zen 5's measurement against two a pass was taken while x was still loaded once a feature:
// docs/kernel_rules.md).
template <typename weight_t>
bool half_pairs() {
  return std::is_same_v<weight_t, c10::Half> && cpu_splits_avx512();
}

// The float loop on output features [done, O) of p, split over threads. Past kLinearMaxRows rows
// (float_loop_only), blocks of them: each thread takes its features a chunk at a time through every
// block, so the chunk's weights come from memory once and from L2 for the other blocks (a block at
// a time re-read them all from memory). (Converting a bfloat16 or float16 chunk to float32 once
// for every block took 1.13-1.7x the time at 16-128 rows on the AMD EPYC Zen 3: the loop's own
// conversion in registers is not what bounds it.)
template <typename scalar_t, typename weight_t>
void float_loop(const kernel::LinearProblem<scalar_t, weight_t>& p, int64_t done) {
  const int64_t chunk = p.M > kernel::kLinearMaxRows ? kFeatureChunk : p.O;
  at::parallel_for(done, p.O, grain_of(p.K, sizeof(weight_t)), [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += chunk) {
      each_block(p, first, std::min(end, first + chunk));
    }
  });
}

// False where the kernel declines the call (then the reference runs).
template <typename scalar_t, typename weight_t>
bool run_kernel(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias,
                const Tensor& y) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<weight_t, c10::BFloat16>) {
    // (the tiles' rule first: it reads its setting on every CPU, and implies the dot products')
    const bool tiles = amx_kernel_applies(x.numel() / x.size(-1), x.size(-1), weight.size(0));
    if (tiles || bfloat16_kernel_applies(false, x.numel() / x.size(-1))) {
      run_bfloat16_kernel<uint16_t>(x, weight, scale, bias, y, tiles);
      return true;
    }
  }
  const int64_t K = x.size(-1), O = weight.size(0);
  int64_t done = 0;  // output features already computed
  if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<weight_t, c10::Half>) {
    if (half_tiles_apply(x.numel() / K, K, O)) {
      done = run_float16_tiles(x, weight, bias, y);
      if (done == O) {
        return true;
      }
    }
  }
  const FloatRows rows = float_rows(x);
  if constexpr (std::is_same_v<weight_t, int8_t>) {
    const bool tiles = integer_tiles_apply(rows.M, K, O);
    if ((tiles || integer_kernel_applies(rows.M, K)) && run_integer_kernel(rows, weight, *scale, bias, y, tiles)) {
      return true;
    }
    if (int16_kernel_applies(rows.M) && run_int16_kernel(rows, weight, *scale, bias, y)) {
      return true;
    }
    if (int8_sums_may_overflow(rows)) {
      return false;
    }
    // (past VNNI's rows: the conversion to bfloat16 is shared by every row, each row then one
    // vdpbf16ps per 32 weights, against an FMA per 16 in the float loop)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (bfloat16_kernel_applies(true, rows.M)) {
        run_bfloat16_kernel<int8_t>(x, weight, scale, bias, y);
        return true;
      }
    }
  }
  const kernel::LinearProblem<scalar_t, weight_t> problem{
      rows.data, weight.const_data_ptr<weight_t>(), weight.stride(0),
      is_present(scale) ? scale->const_data_ptr<float>() : nullptr,
      is_present(bias) ? bias->const_data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), rows.M, K, O,
      weights_to_l2<weight_t>(), half_pairs<weight_t>(), prefetch_in_order()};
  float_loop(problem, done);
  return true;
}

// The kernel into y (x's rows by the weight's, contiguous), where kernel_applies holds; false,
// with y unspecified, where the kernel hands the call back (int8 sums that could overflow).
bool run_into(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias,
              const Tensor& y) {
  bool done = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_linear_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      done = is_present(scale) ? run_kernel<scalar_t, int8_t>(x, weight, scale, bias, y)
                               : run_kernel<scalar_t, scalar_t>(x, weight, scale, bias, y);
    }
  });
  return done;
}

// Whether run_kernel takes x's rows only in the float loop, the one path that takes more than
// kLinearMaxRows rows in a call (in blocks): the AVX2 copy has no other past one row (tiles, VNNI
// and dot products are AVX-512's), nor has float32 x against float32 weights.
bool float_loop_only(const Tensor& x, const OptionalTensor& scale) {
  return cpu_capability() == Capability::kAvx2 || (x.scalar_type() == at::kFloat && !is_present(scale));
}

// The kernel on up to kLinearMaxRows rows of x at once, or on blocks of that many up to
// blocked_rows: all in one call where only the float loop runs, else a block at a time, each
// written into its rows of the output.
std::optional<Tensor> run(const Tensor& x, const Tensor& weight, const OptionalTensor& scale,
                          const OptionalTensor& bias) {
  const int64_t K = x.dim() > 0 ? x.size(-1) : 0;
  const int64_t rows = K > 0 ? x.numel() / K : 0;
  const bool blocks = rows > kernel::kLinearMaxRows && rows <= blocked_rows(x, weight, is_present(scale)) &&
      !x.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
  const Tensor flat = blocks ? x.reshape({rows, K}) : x;
  // (the first block's check stands for every block's: they differ only in their 1-8 rows; it
  // comes before the output's shape is read from the weight)
  if (!kernel_applies(blocks ? flat.narrow(0, 0, kernel::kLinearMaxRows) : x, weight, scale, bias)) {
    return std::nullopt;
  }
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  Tensor y = at::empty(sizes, x.options());
  if (!blocks) {
    return run_into(x, weight, scale, bias, y) ? std::optional<Tensor>(y) : std::nullopt;
  }
  const Tensor out = y.view({rows, weight.size(0)});
  if (float_loop_only(x, scale)) {
    return run_into(flat, weight, scale, bias, out) ? std::optional<Tensor>(y) : std::nullopt;
  }
  for (int64_t row = 0; row < rows; row += kernel::kLinearMaxRows) {
    const int64_t n = std::min(kernel::kLinearMaxRows, rows - row);
    if (!run_into(flat.narrow(0, row, n), weight, scale, bias, out.narrow(0, row, n))) {
      return std::nullopt;
    }
  }
  return y;
}

}  // namespace

bool small_linear_serves(const Tensor& x, const Tensor& weight) {
  const int64_t rows = x.numel() / x.size(-1);
  return enabled() && (rows <= kernel::kLinearMaxRows || rows <= blocked_rows(x, weight, /*quantized=*/false));
}

std::optional<Tensor> small_linear(const Tensor& x, const Tensor& weight, const OptionalTensor& bias) {
  return run(x, weight, std::nullopt, bias);
}

std::optional<Tensor> quantized_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                                       const OptionalTensor& bias) {
  return run(x, weight, scale, bias);
}

bool small_linear_into(const Tensor& x, const Tensor& weight, const OptionalTensor& scale, const OptionalTensor& bias,
                       const Tensor& y) {
  return kernel_applies(x, weight, scale, bias) && y.is_contiguous() && y.scalar_type() == x.scalar_type() &&
      y.numel() == x.numel() / x.size(-1) * weight.size(0) && run_into(x, weight, scale, bias, y);
}

}  // namespace torchmha::cpu
