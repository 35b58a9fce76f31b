// FP8 (OCP E4M3FN) numbers and the block-scaled quantization of the FP8 recipe (DeepSeek-V3's;
// docs/FP8.md): the definition every FP8 kernel is checked against, bit for bit.
//
// e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; NaN = S.1111.111;
// largest finite 448 (S.1111.110); subnormals m * 2^-9 (m = 1..7); both zeros.
//
// Tiles: a matrix [rows, cols] row-major is cut into tiles of `tile_rows` x 128 along its columns
// (the GEMM's K): tile_rows = 1 gives the 1x128 row tiles of activations and gradients, 128 the
// 128x128 blocks of weights. The last tile of a row (cols not a multiple of 128) and the last
// block row (rows not a multiple of 128) are partial. Each tile has one fp32 scale; the scales
// are stored [ceil(rows / tile_rows), ceil(cols / 128)] row-major (row tiles: [rows, tiles];
// weight blocks: [ceil(N/128), ceil(K/128)]), and the codes [rows, cols] row-major like the
// input. A value x of a tile with scale s has code e4m3(x / s); it dequantizes to e4m3(x / s) * s.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/hd.hpp"

namespace moka::core {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3NaN = 0x7F;               // the NaN NVIDIA's cvt writes (S.1111.111, S = 0)
inline constexpr int64_t kFp8TileCols = 128;            // tile width along K, and the promotion interval
inline constexpr int64_t kFp8RowTileRows = 1;           // activations and gradients: 1x128
inline constexpr int64_t kFp8BlockRows = 128;           // weights: 128x128
inline constexpr float kFp8MinScale = 1.17549435e-38f;  // FLT_MIN: the smallest normal float

MOKA_HD int64_t fp8_tiles(int64_t n, int64_t tile) { return (n + tile - 1) / tile; }

MOKA_HD uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

MOKA_HD float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// float -> e4m3, round to nearest, ties to even, saturating: |x| > 448 (infinities included)
// gives ±448, as NVIDIA's cvt.rn.satfinite.e4m3x2.f32 does, so an outlier costs its own accuracy
// instead of turning into NaN. NaN gives kE4m3NaN. -0 keeps its sign (0x80).
MOKA_HD uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return kE4m3NaN;
  if (a >= 0x43E00000) return sign | 0x7E;  // |x| >= 448
  const int32_t exponent = static_cast<int32_t>(a >> 23) - 127;
  if (exponent >= -6) {
    // Normal: keep 3 of the 23 mantissa bits, rounding to nearest even; a carry moves into the
    // exponent, which is what rounding up to the next binade means. Rebias 127 -> 7.
    const uint32_t rounded = a + 0x7FFFF + ((a >> 20) & 1);
    return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));
  }
  // Below 2^-6: the code is round(|x| / 2^-9) (0..8; 8 is the code of 2^-6, the smallest
  // normal). |x| = mantissa * 2^(exponent - 23) with the implicit bit (floats' own subnormals
  // have exponent -126 and none), so the code is mantissa >> (14 - exponent), rounded.
  const bool float_normal = (a >> 23) != 0;
  const uint32_t mantissa = float_normal ? ((a & 0x7FFFFF) | 0x800000) : a;
  const int32_t shift = 14 - (float_normal ? exponent : -126);
  if (shift > 24) return sign;  // below 2^-10, half the smallest subnormal: zero
  const uint32_t code = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | static_cast<uint8_t>(code + ((rest > half || (rest == half && (code & 1))) ? 1 : 0));
}

// Where the GPU's grouped layout keeps row r's scale of column tile t (cuda/gemm/fp8_quantize.hpp):
// the rows are cut into segments (an expert's rows of a grouped buffer, from `first`, `count`
// rows), each segment's scales a [col_tiles, count] block (rows contiguous: the A-scale layout of
// CUTLASS's sm90 blockwise-scaled GEMM) after the previous segments' blocks.
MOKA_HD int64_t segment_scale_index(int64_t first, int64_t count, int64_t col_tiles, int64_t r, int64_t t) {
  return first * col_tiles + t * count + (r - first);
}

// Where the K-major copies of the weight gradients' operands keep segment s (an expert's rows of a
// grouped buffer, from row `first`; cuda/gemm/fp8_quantize.hpp, quantize_columns_e4m3): the rows
// become columns of codes [cols, transposed_pitch], the segment's from column
// transposed_column(first, s), a multiple of 16 (each GEMM group's base must be 16-byte aligned
// for TMA); its scales, one per column per 128 of its rows, are rows transposed_block(first, s)..
// of a [transposed_blocks, cols] buffer (cols contiguous: the MN-major layout CUTLASS reads, with
// the rows as K). Closed forms in (first, s), so no kernel needs a prefix sum over the device-side
// counts: with contiguous segments, s + 1 starts at least count columns (rounded up to 16) and
// ceil(count / 128) blocks after s, as floor(a + b) >= floor(a) + floor(b).
MOKA_HD int64_t transposed_column(int64_t first, int64_t segment) { return (first + 15 * segment) / 16 * 16; }
MOKA_HD int64_t transposed_block(int64_t first, int64_t segment) { return (first + 127 * segment) / 128; }
// The columns and scale rows that hold every segment of `rows` rows cut into `segments`.
MOKA_HD int64_t transposed_pitch(int64_t rows, int64_t segments) { return transposed_column(rows, segments); }
MOKA_HD int64_t transposed_blocks(int64_t rows, int64_t segments) { return transposed_block(rows, segments); }

// e4m3 -> float, exact (every e4m3 value is a float).
MOKA_HD float e4m3_to_float(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  const uint32_t exponent = (c >> 3) & 0xF, mantissa = c & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return bits_float(0x7FC00000 | sign);
  if (exponent == 0) return bits_float(sign | float_bits(static_cast<float>(mantissa) * 0.001953125f));
  return bits_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// The max of |values| that a NaN wins: a tile with a NaN must not look finite. (CUDA's fmaxf
// drops NaN operands; kernels use this instead.)
MOKA_HD float nan_abs_max(float amax, float x) {
  const float a = x < 0 ? -x : x;
  if (a != a || amax != amax) return a + amax;  // NaN
  return a > amax ? a : amax;
}

// A tile's scale from its amax: amax / 448 in fp32, so the tile's largest value lands on 448.
// Not rounded to a power of two: on Hopper the scales are applied in fp32 by the GEMM's
// promotion step, not by the tensor core, so an exact power of two buys nothing and would give up
// to half of the top binade (a power-of-two scale maps amax anywhere in (224, 448]); DeepSeek-V3
// does the same (UE8M0 scales are Blackwell's hardware format). At least FLT_MIN: a zero tile (or
// one below 448 * 2^-126) gets a normal, nonzero scale, so quantizing never divides by zero and
// no scale is a subnormal a flush-to-zero kernel would read as 0; its values quantize to codes 0
// (or the smallest subnormals) as they would with any tiny scale. A tile holding a NaN or an
// infinity gets a NaN scale: all its values quantize to NaN, and NaN propagates through every
// GEMM that reads the tile (an infinity has no e4m3 code to keep).
MOKA_HD float fp8_scale(float amax) {
  if (!(amax <= 3.40282347e38f)) return bits_float(0x7FC00000);  // NaN or +inf
  const float s = amax / kE4m3Max;
  return s > kFp8MinScale ? s : kFp8MinScale;
}

// One value's code in a tile with scale s: e4m3(x / s), with IEEE division (kernels: __fdiv_rn,
// not a reciprocal multiply or fast-math division, which round differently).
MOKA_HD uint8_t quantize_e4m3(float x, float scale) { return float_to_e4m3(x / scale); }

// Quantizes x [rows, cols] (row-major, leading dimension ld) into codes [rows, cols] and scales
// [ceil(rows / tile_rows), ceil(cols / 128)] (layouts above). Inputs of another floating type are
// rounded to float first (the CPU layer's f64 path), so they get the codes their float copy gets.
template <typename In>
void quantize_tiles(const In* x, int64_t rows, int64_t cols, int64_t ld, int64_t tile_rows, uint8_t* codes,
                    float* scales) {
  const int64_t col_tiles = fp8_tiles(cols, kFp8TileCols);
  for (int64_t tr = 0; tr < fp8_tiles(rows, tile_rows); ++tr) {
    const int64_t r0 = tr * tile_rows, r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
    for (int64_t tc = 0; tc < col_tiles; ++tc) {
      const int64_t c0 = tc * kFp8TileCols, c1 = c0 + kFp8TileCols < cols ? c0 + kFp8TileCols : cols;
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = nan_abs_max(amax, static_cast<float>(x[r * ld + c]));
      const float scale = fp8_scale(amax);
      scales[tr * col_tiles + tc] = scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) codes[r * cols + c] = quantize_e4m3(static_cast<float>(x[r * ld + c]), scale);
    }
  }
}

// codes and scales (layouts above) -> values [rows, cols]: code value * scale, computed in Out
// (exact in double; rounded once in float).
template <typename Out>
void dequantize_tiles(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols, int64_t tile_rows,
                      Out* out) {
  const int64_t col_tiles = fp8_tiles(cols, kFp8TileCols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = static_cast<Out>(e4m3_to_float(codes[r * cols + c])) *
                          static_cast<Out>(scales[(r / tile_rows) * col_tiles + c / kFp8TileCols]);
}

}  // namespace moka::core
