// bfloat16 x against bfloat16 weights on AMX tiles (linear_kernel.h, "amx_bf16"), built for
// AMX-BF16 (flags in CMakeLists.txt; run only where the CPU has amx_bf16 and Linux granted this
// process the tile state: small_linear_kernel.cpp).
//
// Why: from 3-4 rows of x, AVX512-BF16's dot products are bound by their own instructions (one
// vdpbf16ps per 32 weights and row, and a reduction per feature and row): 8 rows read the weights
// at half the read rate. tdpbf16ps multiplies a tile of 16 weight rows x 32 columns by all rows of
// x at once, so the weights are read at the memory's rate for any row count up to 16.
//
// The weight tile is tdpbf16ps's A operand, loaded in place (16 rows of W at their row stride);
// x is its B operand, packed once a call (pack_rows: the k pairs of each 32 columns as rows).
// Products of two bfloat16 values are exact in float and summed in float, as vdpbf16ps's are (and,
// like it, subnormal inputs read as zero).
//
// Plain intrinsics only (nothing inline of ATen's or c10's), as in linear_kernel_bf16.cpp.

#include "linear_kernel.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace torchmha::cpu::kernel::amx_bf16 {
namespace {

constexpr int kTileRows = static_cast<int>(kLinearMaxRows);  // rows of x a tile holds

// ldtilecfg's 64-byte operand: palette 1, then each tile's bytes a row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles (numbers, not names: the tile intrinsics paste them into the instruction): 0 is C (16
// features x 8 rows of x, float), 1 is A (16 weight rows x 32 bfloat16), 2 is B (16 k pairs x 8
// rows of x, two bfloat16 each).

// Rows 4L + j (L the 128-bit lane) of one 32-column block: lane L of `low` (x rows 0-3) beside
// lane L of `high` (rows 4-7), 32 bytes a row.
void store_pair_rows(__m512i low, __m512i high, int j, uint32_t* block) {
  const __m512i halves = _mm512_shuffle_i32x4(low, high, _MM_SHUFFLE(1, 0, 1, 0));  // low 0, 1, high 0, 1
  const __m512i upper = _mm512_shuffle_i32x4(low, high, _MM_SHUFFLE(3, 2, 3, 2));   // low 2, 3, high 2, 3
  const __m512i rows01 = _mm512_shuffle_i32x4(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));
  const __m512i rows23 = _mm512_shuffle_i32x4(upper, upper, _MM_SHUFFLE(3, 1, 2, 0));
  const auto store = [&](int row, __m256i value) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(block + row * kTileRows), value);
  };
  store(j, _mm512_castsi512_si256(rows01));
  store(4 + j, _mm512_extracti64x4_epi64(rows01, 1));
  store(8 + j, _mm512_castsi512_si256(rows23));
  store(12 + j, _mm512_extracti64x4_epi64(rows23, 1));
}

// 16 lanes of float to bfloat16 bits as to_bfloat16 does each (round to nearest even, NaN quiet).
__m256i to_bfloat16(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// One pass of transpose_tile: vectors of F features x R rows of x (lanes feature-major; v[g * 8 / R
// + h] holds features group g, rows group h) into vectors of 2F features x R / 2 rows.
template <int F, int R>
void double_features(__m512 v[8]) {
  constexpr int groups = 16 / F, row_groups = 8 / R;
  const auto index = [](int half) {
    alignas(64) int32_t lanes[16];
    for (int l = 0; l < 16; ++l) {
      const int f = l / (R / 2), r = l % (R / 2);
      lanes[l] = (f >= F ? 16 : 0) + (f % F) * R + half * (R / 2) + r;
    }
    return _mm512_load_si512(lanes);
  };
  const __m512i low = index(0), high = index(1);
  __m512 next[8];
  for (int g = 0; g < groups / 2; ++g) {
    for (int h = 0; h < row_groups; ++h) {
      const __m512 a = v[2 * g * row_groups + h], b = v[(2 * g + 1) * row_groups + h];
      next[g * 2 * row_groups + 2 * h] = _mm512_permutex2var_ps(a, low, b);
      next[g * 2 * row_groups + 2 * h + 1] = _mm512_permutex2var_ps(a, high, b);
    }
  }
  for (int i = 0; i < 8; ++i) v[i] = next[i];
}

// The C tile (16 features x 8 rows of x, row-major) transposed: v[m] holds row m's 16 features.
// Three passes of two-source permutes: (2 x 8) -> (4 x 4) -> (8 x 2) -> (16 x 1) (8 gathers, one
// a row, cost more).
void transpose_tile(const float (*c)[kTileRows], __m512 v[kTileRows]) {
  for (int g = 0; g < 8; ++g) v[g] = _mm512_loadu_ps(c[2 * g]);
  double_features<2, 8>(v);
  double_features<4, 4>(v);
  double_features<8, 2>(v);
}

// The C tile (features o .. o + 15 by rows of x) plus bias into y's rows.
void store_features(const BFloat16Problem<uint16_t>& p, const float (*c)[kTileRows], int64_t o) {
  __m512 rows[kTileRows];
  transpose_tile(c, rows);
  const __m512 bias = p.bias != nullptr
      ? _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.bias + o))), 16))
      : _mm512_setzero_ps();
  for (int64_t m = 0; m < p.M; ++m) {
    const __m512 sums = p.bias != nullptr ? _mm512_add_ps(rows[m], bias) : rows[m];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y + m * p.O + o), to_bfloat16(sums));
  }
}

}  // namespace

bool request_tiles() {
  // (Linux 5.16+: a process asks once for the tile state, XFEATURE_XTILEDATA, before its first
  // tile instruction; oneDNN asks the same when torch runs its own AMX GEMMs)
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

void pack_rows(const uint16_t* x, int64_t M, int64_t K, uint32_t* packed) {
  // As 32-bit pairs, x is (M, K / 2): B is its transpose, 16 pairs (32 columns) a tile, each pair
  // row 8 wide (rows of x past M zero). A transpose of 8 x 16 pairs through unpacks and lane shuffles.
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);
  const int64_t row_pairs = K / 2;
  for (int64_t block = 0; block < K / 32; ++block) {
    __m512i r[kTileRows];
    for (int m = 0; m < kTileRows; ++m) {
      r[m] = m < M ? _mm512_loadu_si512(pairs + m * row_pairs + block * 16) : _mm512_setzero_si512();
    }
    __m512i t[kTileRows];
    for (int m = 0; m < kTileRows; m += 2) {
      t[m] = _mm512_unpacklo_epi32(r[m], r[m + 1]);      // per lane: pairs 0, 1 of rows m, m + 1
      t[m + 1] = _mm512_unpackhi_epi32(r[m], r[m + 1]);  // pairs 2, 3
    }
    uint32_t* out = packed + block * 16 * kTileRows;
    for (int half = 0; half < 2; ++half) {  // rows 0-3, rows 4-7 of x
      const __m512i* h = t + 4 * half;
      const __m512i u[4] = {_mm512_unpacklo_epi64(h[0], h[2]), _mm512_unpackhi_epi64(h[0], h[2]),
                            _mm512_unpacklo_epi64(h[1], h[3]), _mm512_unpackhi_epi64(h[1], h[3])};
      for (int j = 0; j < 4; ++j) r[4 * half + j] = u[j];  // pair 4L + j of rows 4 half .. 4 half + 3
    }
    for (int j = 0; j < 4; ++j) store_pair_rows(r[j], r[4 + j], j, out);
  }
}

void tile_rows(const BFloat16Problem<uint16_t>& p, const uint32_t* packed, int64_t begin, int64_t end) {
  TileConfig config;
  config.rows[0] = config.rows[1] = config.rows[2] = 16;
  config.bytes_per_row[0] = config.bytes_per_row[2] = kTileRows * 4;
  config.bytes_per_row[1] = 64;
  _tile_loadconfig(&config);
  const int64_t stride = p.w_stride * 2;
  alignas(64) float c[16][kTileRows];
  for (int64_t block = begin; block < end; ++block) {
    const uint16_t* w = p.w + block * 16 * p.w_stride;
    // (the next block's rows, a step ahead: 16 rows read side by side are 16 short streams that the
    // hardware's prefetcher follows late; measured 0.21-0.22 against 0.23-0.24 ms for 8 MB)
    const uintptr_t next = reinterpret_cast<uintptr_t>(w) + 16 * stride;
    _tile_zero(0);
    for (int64_t k = 0; k < p.K; k += 32) {
      for (int row = 0; row < 16; ++row) {
        _mm_prefetch(reinterpret_cast<const char*>(next + row * stride + k * 2), _MM_HINT_T0);
      }
      _tile_loadd(2, packed + k / 2 * kTileRows, kTileRows * 4);
      _tile_loadd(1, w + k, stride);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, kTileRows * 4);
    store_features(p, c, block * 16);
  }
  _tile_release();
}

}  // namespace torchmha::cpu::kernel::amx_bf16
