// The small-batch linear on AMX tiles (linear_kernel.h, "amx"), built for AMX-BF16 and AMX-INT8
// (flags in CMakeLists.txt; run only where the CPU has them and Linux granted this process the
// tile state: small_linear_kernel.cpp): bfloat16 x against bfloat16 weights, and x's exact
// integer digits (linear_kernel_vnni.cpp's) against int8 weights.
//
// Why: from 3-4 rows of x, AVX512-BF16's dot products are bound by their own instructions (one
// vdpbf16ps per 32 weights and row, and a reduction per feature and row): 8 rows read the weights
// at half the read rate. tdpbf16ps multiplies a tile of 16 weight rows x 32 columns by all rows of
// x at once (up to 8 here, 16 in a tile), so its work per weight does not grow with the rows.
//
// The weight tile is tdpbf16ps's A operand, loaded in place (16 rows of W at their row stride);
// x is its B operand, packed once a call (pack_rows: the k pairs of each 32 columns as rows).
// Products of two bfloat16 values are exact in float and summed in float, as vdpbf16ps's are (and,
// like it, subnormal inputs read as zero).
//
// float16 weights (no AMX-FP16 here): each value split exactly into two bfloat16 halves, the
// weights' per k-step into an L1 buffer as the A tiles, x's once a call as B; the four products
// of the halves are exact in float, so the sums are float16's own products summed in float.
//
// int8 weights: the weight tile is tdpbssd's A operand, in place; the B tiles are x's four base-256
// digits (integer_rows), so each product is exact in int32 and the digits are combined exactly in
// int64, as the VNNI kernel does: the same results, bit for bit, at any row count up to 8.
//
// Plain intrinsics only (nothing inline of ATen's or c10's), as in linear_kernel_bf16.cpp.

#include "linear_kernel.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace torchmha::cpu::kernel::amx {
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

// Tiles are numbers, not names, below: the tile intrinsics paste them into the instruction.

// Rows 4L + j (L the 128-bit lane) of one transposed block: lane L of `low` (source rows 0-3)
// beside lane L of `high` (rows 4-7), the first `width` words of each, rows `stride` words apart.
void store_word_rows(__m512i low, __m512i high, int j, uint32_t* block, int64_t stride, int64_t width) {
  const __mmask8 lanes = static_cast<__mmask8>((1u << width) - 1);
  const __m512i halves = _mm512_shuffle_i32x4(low, high, _MM_SHUFFLE(1, 0, 1, 0));  // low 0, 1, high 0, 1
  const __m512i upper = _mm512_shuffle_i32x4(low, high, _MM_SHUFFLE(3, 2, 3, 2));   // low 2, 3, high 2, 3
  const __m512i rows01 = _mm512_shuffle_i32x4(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));
  const __m512i rows23 = _mm512_shuffle_i32x4(upper, upper, _MM_SHUFFLE(3, 1, 2, 0));
  const auto store = [&](int row, __m256i value) {
    _mm256_mask_storeu_epi32(block + row * stride, lanes, value);
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

// Columns of one B (and C) tile for M rows of x: their 4M digit columns in one tile up to 4 rows,
// else in two (16 columns at most a tile).
int64_t digit_columns(int64_t M) {
  return M <= 4 ? 4 * M : 2 * M;
}

// The C tiles of features o .. o + 15 into y's rows: each feature's digit sums combined exactly in
// int64 (8 rows a vector), then as the VNNI kernel: dot * step * scale (+ bias) in double, to float.
void store_integer_features(const IntegerProblem& p, const int32_t (*c)[16][16], int64_t o) {
  const int64_t width = digit_columns(p.M);
  const __mmask8 rows_of_x = static_cast<__mmask8>((1u << p.M) - 1);
  const __m512d steps = _mm512_maskz_loadu_pd(rows_of_x, p.x.steps);
  alignas(64) float sums[16][kTileRows];
  for (int i = 0; i < 16; ++i) {
    __m512i dot = _mm512_setzero_si512();
    for (int l = 0; l < kDigits; ++l) {  // digit l of rows 0 .. M - 1, widened to int64
      const int32_t* column = &c[(l * p.M) / width][i][(l * p.M) % width];
      const __m512i digit = _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(rows_of_x, column));
      dot = _mm512_add_epi64(dot, _mm512_slli_epi64(digit, 8 * l));
    }
    __m512d y = _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi64_pd(dot), steps), _mm512_set1_pd(p.scale[o + i]));
    if (p.bias != nullptr) {
      y = _mm512_add_pd(y, _mm512_set1_pd(p.bias[o + i]));
    }
    _mm256_store_ps(sums[i], _mm512_cvtpd_ps(y));
  }
  __m512 rows[kTileRows];
  transpose_tile(sums, rows);
  for (int64_t m = 0; m < p.M; ++m) _mm512_storeu_ps(p.y + m * p.O + o, rows[m]);
}

// Software prefetch for a block of 16 weight rows read a k-step (64 bytes a row) at a time: the
// lines kAhead steps on, running on into the next block's rows (16 rows read side by side are
// short streams that the hardware's prefetcher follows late). Measured on the Intel Xeon with AMX
// (an 8192 x 4096 int8 weight, 1 row of x): 0.89-0.91 of a sum's rate 2-4 steps ahead, 0.70 with
// the whole next block fetched during this one; weight_reads' 36 bfloat16 matrices: 4 ahead 1.02-1.10
// of the sum, 8 0.99-1.04, 16 0.89-1.10.
constexpr int64_t kAhead = 4;
void prefetch_ahead(const char* w, int64_t stride, int64_t step, int64_t steps) {
  const int64_t target = step + kAhead;
  const char* line = target < steps ? w + target * 64 : w + 16 * stride + (target - steps) * 64;
  for (int row = 0; row < 16; ++row) {
    _mm_prefetch(line + row * stride, _MM_HINT_T0);
  }
}

// 32 float16 values (bits) as two bfloat16 halves, exactly: high (the float's top 16 bits) and
// low = value - high (float16's 11 significant bits leave at most 3 for it). inf keeps a zero low
// half (inf - inf would be NaN); NaN stays NaN in both.
void split_halves(const uint16_t* values, __m512i& high, __m512i& low) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 h[2], l[2];
  for (int i = 0; i < 2; ++i) {
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 16 * i)));
    h[i] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(f), top));
    l[i] = _mm512_sub_ps(f, h[i]);
  }
  high = (__m512i)_mm512_cvtne2ps_pbh(h[1], h[0]);
  low = (__m512i)_mm512_cvtne2ps_pbh(l[1], l[0]);
}

// y[m, o] of float16 values as a plain float sum (bias included): torch's answer where the halves'
// cross products made a NaN of an infinite sum (0 x inf, a zero low half against an infinite
// value); infinite and NaN sums come out the same in any order.
float plain_sum(const BFloat16Problem<uint16_t>& p, int64_t m, int64_t o) {
  float sum = 0.0f;
  for (int64_t k = 0; k < p.K; ++k) {
    sum += _cvtsh_ss(p.w[o * p.w_stride + k]) * _cvtsh_ss(p.x[m * p.K + k]);
  }
  return p.bias != nullptr ? sum + _cvtsh_ss(p.bias[o]) : sum;
}

// The C tiles of float16_tiles (features o .. o + 15; columns: rows of x against x's high halves,
// then against its low halves; a tile for each half of the weights) into y's rows: the two columns of each row summed, plus bias; a
// NaN there again as plain_sum.
void store_half_features(const BFloat16Problem<uint16_t>& p, const float (*c)[16][16], int64_t o) {
  const __m512i low_half = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(p.M)));
  alignas(64) float sums[16][kTileRows];
  for (int i = 0; i < 16; ++i) {
    const __m512 row = _mm512_add_ps(_mm512_load_ps(c[0][i]), _mm512_load_ps(c[1][i]));
    const __m512 total = _mm512_add_ps(row, _mm512_permutexvar_ps(low_half, row));
    _mm256_store_ps(sums[i], _mm512_castps512_ps256(total));
  }
  __m512 rows[kTileRows];
  transpose_tile(sums, rows);
  const __m512 bias = p.bias != nullptr
      ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.bias + o)))
      : _mm512_setzero_ps();
  for (int64_t m = 0; m < p.M; ++m) {
    __m512 y = p.bias != nullptr ? _mm512_add_ps(rows[m], bias) : rows[m];
    if (const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q)) {
      alignas(64) float values[16];
      _mm512_store_ps(values, y);
      for (int i = 0; i < 16; ++i) {
        if ((nan >> i) & 1) values[i] = plain_sum(p, m, o + i);
      }
      y = _mm512_load_ps(values);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y + m * p.O + o), _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
  }
}

// 16 words of each of `rows` source rows (at most 8, `stride` words apart) transposed: 16 rows of
// `rows` words, `out_stride` words apart. Through unpacks and lane shuffles.
void transpose_words(const uint32_t* source, int64_t stride, int64_t rows, uint32_t* out, int64_t out_stride) {
  __m512i r[8];
  for (int m = 0; m < 8; ++m) {
    r[m] = m < rows ? _mm512_loadu_si512(source + m * stride) : _mm512_setzero_si512();
  }
  __m512i t[8];
  for (int m = 0; m < 8; m += 2) {
    t[m] = _mm512_unpacklo_epi32(r[m], r[m + 1]);      // per lane: words 0, 1 of rows m, m + 1
    t[m + 1] = _mm512_unpackhi_epi32(r[m], r[m + 1]);  // words 2, 3
  }
  for (int half = 0; half < 2; ++half) {  // rows 0-3, rows 4-7
    const __m512i* h = t + 4 * half;
    const __m512i u[4] = {_mm512_unpacklo_epi64(h[0], h[2]), _mm512_unpackhi_epi64(h[0], h[2]),
                          _mm512_unpacklo_epi64(h[1], h[3]), _mm512_unpackhi_epi64(h[1], h[3])};
    for (int j = 0; j < 4; ++j) r[4 * half + j] = u[j];  // word 4L + j of rows 4 half .. 4 half + 3
  }
  for (int j = 0; j < 4; ++j) store_word_rows(r[j], r[4 + j], j, out, out_stride, rows);
}

}  // namespace

void pack_rows(const uint16_t* x, int64_t M, int64_t K, uint32_t* packed) {
  // As 32-bit pairs, x is (M, K / 2): B is its transpose, 16 pairs (32 columns) a tile, M wide
  for (int64_t block = 0; block < K / 32; ++block) {
    transpose_words(reinterpret_cast<const uint32_t*>(x) + block * 16, K / 2, M, packed + block * 16 * M, M);
  }
}

void bfloat16_tiles(const BFloat16Problem<uint16_t>& p, const uint32_t* packed, int64_t begin, int64_t end) {
  // Tiles 0: C (16 features x M rows of x, float), 1: A (16 weight rows x 32 bfloat16), 2: B (16 k
  // pairs x M rows, two bfloat16 each)
  TileConfig config;
  config.rows[0] = config.rows[1] = config.rows[2] = 16;
  config.bytes_per_row[0] = config.bytes_per_row[2] = static_cast<uint16_t>(p.M * 4);
  config.bytes_per_row[1] = 64;
  _tile_loadconfig(&config);
  const int64_t stride = p.w_stride * 2, steps = p.K / 32;
  alignas(64) float c[16][kTileRows];
  for (int64_t block = begin; block < end; ++block) {
    const char* w = reinterpret_cast<const char*>(p.w + block * 16 * p.w_stride);
    _tile_zero(0);
    for (int64_t step = 0; step < steps; ++step) {
      prefetch_ahead(w, stride, step, steps);
      _tile_loadd(2, packed + step * 16 * p.M, p.M * 4);
      _tile_loadd(1, w + step * 64, stride);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, kTileRows * 4);
    store_features(p, c, block * 16);
  }
  _tile_release();
}

void pack_halves(const uint16_t* x, int64_t M, int64_t K, uint16_t* halves, uint32_t* packed) {
  // x's rows split (split_halves) into `halves` (M high rows, then M low rows, K each); each 32
  // columns' B tile: 16 pair rows of 2M words, high halves' columns first
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 32) {
      __m512i high, low;
      split_halves(x + m * K + k, high, low);
      _mm512_storeu_si512(halves + m * K + k, high);
      _mm512_storeu_si512(halves + (M + m) * K + k, low);
    }
  }
  const uint32_t* words = reinterpret_cast<const uint32_t*>(halves);
  for (int64_t block = 0; block < K / 32; ++block) {
    uint32_t* tile = packed + block * 16 * 2 * M;
    transpose_words(words + block * 16, K / 2, M, tile, 2 * M);
    transpose_words(words + M * K / 2 + block * 16, K / 2, M, tile + M, 2 * M);
  }
}

void float16_tiles(const BFloat16Problem<uint16_t>& p, const uint32_t* packed, int64_t begin, int64_t end) {
  // Tiles 0 and 4: C (16 features x 2M columns, float; the weights' high and low halves), 1 and 3: A
  // (16 weight rows x 32, high and low halves), 2: B (16 k pairs x 2M: x's high halves, then its
  // low halves). (w_h + w_l)(x_h + x_l): every product exact in float, as float16's own are.
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = static_cast<uint16_t>(t == 1 || t == 3 ? 64 : p.M * 8);
  }
  _tile_loadconfig(&config);
  const int64_t stride = p.w_stride * 2, steps = p.K / 32;
  // The weights' halves, a k-step ahead of the tiles that load them (two buffers: a tile load
  // right after the stores it reads waits for them)
  alignas(64) uint16_t high[2][16][32], low[2][16][32];
  const auto split_step = [&](const char* w, int64_t step) {
    for (int row = 0; row < 16; ++row) {
      __m512i h, l;
      split_halves(reinterpret_cast<const uint16_t*>(w + row * stride + step * 64), h, l);
      _mm512_store_si512(high[step & 1][row], h);
      _mm512_store_si512(low[step & 1][row], l);
    }
  };
  alignas(64) float c[2][16][16];
  for (int64_t block = begin; block < end; ++block) {
    const char* w = reinterpret_cast<const char*>(p.w + block * 16 * p.w_stride);
    _tile_zero(0);
    _tile_zero(4);
    split_step(w, 0);
    for (int64_t step = 0; step < steps; ++step) {
      prefetch_ahead(w, stride, step, steps);
      _tile_loadd(2, packed + step * 16 * 2 * p.M, p.M * 8);
      _tile_loadd(1, high[step & 1], 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_loadd(3, low[step & 1], 64);
      _tile_dpbf16ps(4, 3, 2);
      if (step + 1 < steps) {
        split_step(w, step + 1);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(4, c[1], 64);
    store_half_features(p, c, block * 16);
  }
  _tile_release();
}

void pack_digits(const IntegerRows& x, int64_t M, uint32_t* packed) {
  // Each k-step's tiles (64 columns; one tile of 4M columns up to 4 rows, else two of 2M): digit l
  // of rows 0 .. M - 1 at column l M (l % 2 M in tile l / 2); a column's 4 digits of a k quad one word.
  const uint32_t* words = reinterpret_cast<const uint32_t*>(x.digits);
  const int64_t row_words = x.padded_k / 4, width = digit_columns(M);
  for (int64_t step = 0; step < x.padded_k / 64; ++step) {
    uint32_t* tiles = packed + step * 64 * M;
    for (int l = 0; l < kDigits; ++l) {
      const int64_t tile = (l * M) / width, column = (l * M) % width;
      transpose_words(words + l * row_words + step * 16, kDigits * row_words, M, tiles + tile * 16 * width + column,
                      width);
    }
  }
}

void integer_tiles(const IntegerProblem& p, const uint32_t* packed, int64_t begin, int64_t end) {
  // Tiles 0-1: C (16 features x the digit columns, int32), 2: A (16 weight rows x 64 int8), 3-4: B
  const int64_t width = digit_columns(p.M), tiles = kDigits * p.M / width;
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = static_cast<uint16_t>(t == 2 ? 64 : width * 4);
  }
  _tile_loadconfig(&config);
  const int64_t steps = p.K / 64;
  alignas(64) int32_t c[2][16][16];
  for (int64_t block = begin; block < end; ++block) {
    const char* w = reinterpret_cast<const char*>(p.w + block * 16 * p.w_stride);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t step = 0; step < steps; ++step) {
      prefetch_ahead(w, p.w_stride, step, steps);
      const uint32_t* b = packed + step * 64 * p.M;
      _tile_loadd(2, w + step * 64, p.w_stride);
      _tile_loadd(3, b, width * 4);
      _tile_dpbssd(0, 2, 3);
      if (tiles == 2) {
        _tile_loadd(4, b + 16 * width, width * 4);
        _tile_dpbssd(1, 2, 4);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    store_integer_features(p, c, block * 16);
  }
  _tile_release();
}

}  // namespace torchmha::cpu::kernel::amx
