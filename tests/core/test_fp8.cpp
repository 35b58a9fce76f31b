// e4m3 conversion against the OCP E4M3FN table built independently here, and the 1x128 / 128x128
// tile quantizers (core/fp8.hpp).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/fp8.hpp"

using namespace moka::core;

namespace {

// The OCP table from its definition: exponent field e (bias 7), mantissa m; e = 0 is subnormal.
double ocp_e4m3_value(int code) {
  const int e = (code >> 3) & 0xF, m = code & 0x7;
  const double magnitude = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (code & 0x80) ? -magnitude : magnitude;
}
bool ocp_e4m3_is_nan(int code) { return (code & 0x7F) == 0x7F; }

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

TEST(E4m3, AllCodesDecodeToTheOcpTable) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    if (ocp_e4m3_is_nan(c)) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), ocp_e4m3_value(c)) << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
}

// Every float in [2^-12, 448] of either sign (and a sample below) against the midpoints of the
// table: below a midpoint the lower code, above it the upper, on it the even one.
TEST(E4m3, EveryFloatBetweenCodesRoundsToNearestEven) {
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = static_cast<float>(ocp_e4m3_value(c)), hi = static_cast<float>(ocp_e4m3_value(c + 1));
    const float mid = (lo + hi) / 2;  // exact: both have at most 4 significant bits
    const uint8_t even = (c & 1) ? static_cast<uint8_t>(c + 1) : static_cast<uint8_t>(c);
    const uint32_t first = to_bits(std::max(lo, std::ldexp(1.0f, -12))), last = to_bits(hi);
    int64_t wrong = 0;
    for (uint32_t u = first; u <= last; ++u) {
      const float f = from_bits(u);
      const uint8_t want = f < mid ? static_cast<uint8_t>(c) : f > mid ? static_cast<uint8_t>(c + 1) : even;
      wrong += float_to_e4m3(f) != want;
      wrong += float_to_e4m3(-f) != (want | 0x80);
    }
    EXPECT_EQ(wrong, 0) << "between codes " << c << " and " << c + 1;
  }
  for (uint32_t u = 0; u < to_bits(std::ldexp(1.0f, -12)); u += 4099) {
    ASSERT_EQ(float_to_e4m3(from_bits(u)), 0x00) << u;
    ASSERT_EQ(float_to_e4m3(-from_bits(u)), 0x80) << u;
  }
}

TEST(E4m3, CodesRoundTrip) {
  for (int c = 0; c < 256; ++c)
    if (!ocp_e4m3_is_nan(c)) EXPECT_EQ(float_to_e4m3(e4m3_to_float(static_cast<uint8_t>(c))), c) << c;
}

TEST(E4m3, SaturatesAt448) {
  for (float f : {448.0f, 448.01f, 463.9f, 464.0f, 480.0f, 1e6f, FLT_MAX, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(float_to_e4m3(f), 0x7E) << f;
    EXPECT_EQ(float_to_e4m3(-f), 0xFE) << f;
  }
  EXPECT_EQ(float_to_e4m3(431.9f), 0x7D);  // 416, the code below 448
  EXPECT_EQ(float_to_e4m3(432.0f), 0x7E);  // the midpoint ties to 448 (even mantissa 110)
}

TEST(E4m3, NanGivesTheNanCode) {
  for (uint32_t u : {0x7FC00000u, 0x7F800001u, 0xFFC00000u, 0x7FFFFFFFu, 0xFF800001u})
    EXPECT_EQ(float_to_e4m3(from_bits(u)), kE4m3NaN) << std::hex << u;
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

TEST(E4m3, SubnormalsAndSignedZero) {
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest: ties to 0
  EXPECT_EQ(float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);   // 1.5 * 2^-9 ties to 2 * 2^-9
  EXPECT_EQ(float_to_e4m3(std::ldexp(15.0f, -10)), 0x08);  // 7.5 * 2^-9 ties to 2^-6
  EXPECT_EQ(float_to_e4m3(-std::ldexp(5.0f, -9)), 0x85);
  EXPECT_EQ(float_to_e4m3(from_bits(1)), 0x00);  // float subnormals: zero
  EXPECT_EQ(float_to_e4m3(-from_bits(0x007FFFFF)), 0x80);
}

namespace {

struct Tiles {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

template <typename In>
Tiles quantize(const std::vector<In>& x, int64_t rows, int64_t cols, int64_t tile_rows) {
  Tiles t{std::vector<uint8_t>(rows * cols),
          std::vector<float>(fp8_tiles(rows, tile_rows) * fp8_tiles(cols, kFp8TileCols))};
  quantize_tiles(x.data(), rows, cols, cols, tile_rows, t.codes.data(), t.scales.data());
  return t;
}

// Values whose magnitude changes by up to 2^±12 from tile to tile and spans 2^±6 inside one.
std::vector<float> ragged_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-6.0f, 6.0f);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = normal(rng) * std::exp2(exponent(rng)) * std::exp2(float((i / 97) % 25 - 12));
  return x;
}

}  // namespace

// Scales follow the documented layout ([tile rows, col tiles] row-major, partial tiles at the
// right and bottom edges) and equal amax / 448 of their tile, computed here from the tile.
class Fp8Tiles : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(Fp8Tiles, ScaleLayoutAndRoundTripError) {
  const auto [rows, cols, tile_rows] = GetParam();
  const auto x = ragged_values(rows * cols, rows * 1000 + cols);
  const Tiles q = quantize(x, rows, cols, tile_rows);
  const int64_t col_tiles = fp8_tiles(cols, kFp8TileCols);
  ASSERT_EQ(q.scales.size(), size_t(fp8_tiles(rows, tile_rows) * col_tiles));
  std::vector<float> amax(q.scales.size(), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& a = amax[(r / tile_rows) * col_tiles + c / kFp8TileCols];
      a = std::max(a, std::abs(x[r * cols + c]));
    }
  for (size_t t = 0; t < amax.size(); ++t) EXPECT_EQ(q.scales[t], amax[t] / 448.0f) << t;

  std::vector<double> back(rows * cols);
  dequantize_tiles(q.codes.data(), q.scales.data(), rows, cols, tile_rows, back.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t t = (r / tile_rows) * col_tiles + c / kFp8TileCols;
      const double v = x[r * cols + c], s = q.scales[t], err = std::abs(back[r * cols + c] - v);
      // Normal e4m3 values (|v| / s >= 2^-6): half a unit in the last of 3 mantissa bits, 2^-4
      // relative (so at most 2^-4 of the tile's amax); below, half the subnormal step 2^-9 * s.
      const double bound = std::abs(v) / s >= std::ldexp(1.0, -6) ? std::ldexp(std::abs(v), -4) : std::ldexp(s, -10);
      ASSERT_LE(err, bound * (1 + 1e-6)) << r << "," << c;
      ASSERT_LE(err, std::ldexp(amax[t], -4) * (1 + 1e-6)) << r << "," << c;
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8Tiles,
                         ::testing::Values(std::make_tuple(int64_t{3}, int64_t{300}, kFp8RowTileRows),
                                           std::make_tuple(int64_t{5}, int64_t{128}, kFp8RowTileRows),
                                           std::make_tuple(int64_t{4}, int64_t{7}, kFp8RowTileRows),
                                           std::make_tuple(int64_t{200}, int64_t{300}, kFp8BlockRows),
                                           std::make_tuple(int64_t{128}, int64_t{256}, kFp8BlockRows),
                                           std::make_tuple(int64_t{9}, int64_t{130}, kFp8BlockRows)));

TEST(Fp8Tiles, ZeroAndTinyTilesGetTheSmallestNormalScale) {
  std::vector<float> x(2 * 256, 0.0f);
  x[1] = -0.0f;
  x[300] = 1e-39f;  // a float subnormal; amax / 448 would be a subnormal too
  const Tiles q = quantize(x, 2, 256, kFp8RowTileRows);
  for (float s : q.scales) EXPECT_EQ(s, FLT_MIN);
  EXPECT_EQ(q.codes[0], 0x00);
  EXPECT_EQ(q.codes[1], 0x80);
  EXPECT_EQ(q.codes[300], float_to_e4m3(1e-39f / FLT_MIN));
  EXPECT_NE(q.codes[300], 0x00);
}

TEST(Fp8Tiles, NanOrInfinityMakesItsTileNan) {
  std::vector<float> x = ragged_values(2 * 300, 5);
  x[130] = std::numeric_limits<float>::quiet_NaN();        // row 0, tile 1
  x[300 + 260] = -std::numeric_limits<float>::infinity();  // row 1, tile 2
  const Tiles q = quantize(x, 2, 300, kFp8RowTileRows);
  EXPECT_TRUE(std::isnan(q.scales[1]));
  EXPECT_TRUE(std::isnan(q.scales[3 + 2]));
  for (int64_t c = 128; c < 256; ++c) EXPECT_EQ(q.codes[c], kE4m3NaN);
  for (int64_t c = 256; c < 300; ++c) EXPECT_EQ(q.codes[300 + c], kE4m3NaN);
  for (int t : {0, 2, 3, 4}) EXPECT_TRUE(std::isfinite(q.scales[t])) << t;
  EXPECT_TRUE(std::isnan(nan_abs_max(std::numeric_limits<float>::quiet_NaN(), 1.0f)));
  EXPECT_TRUE(std::isnan(nan_abs_max(1.0f, -std::numeric_limits<float>::quiet_NaN())));
}

// The CPU layer's f64 path quantizes the float copy of its values.
TEST(Fp8Tiles, DoubleInputsQuantizeAsTheirFloatCopy) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<double> x(3 * 200);
  for (auto& v : x) v = normal(rng);
  const std::vector<float> xf(x.begin(), x.end());
  const Tiles a = quantize(x, 3, 200, kFp8RowTileRows), b = quantize(xf, 3, 200, kFp8RowTileRows);
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.scales, b.scales);
}

// The GPU's grouped scale layout (segment_scale_index): every (row, tile) of every segment gets
// its own slot, the slots fill [first row * tiles, last row * tiles) with no gap, and a segment's
// block is [tiles, count] with its rows contiguous from first * tiles: what the e4m3 grouped GEMM
// reads for an expert whose rows start at `first` (cuda/gemm/grouped_gemm.hpp, GroupSpec).
TEST(Fp8Scales, SegmentBlocksTileTheScaleBufferInTheGemmsLayout) {
  const std::vector<int64_t> offsets = {0, 0, 3, 10, 11, 140};  // an empty segment, a one-row one
  const int64_t tiles = 3, rows = offsets.back();
  std::vector<int> hits(rows * tiles, 0);
  for (size_t s = 0; s + 1 < offsets.size(); ++s) {
    const int64_t first = offsets[s], count = offsets[s + 1] - first;
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t r = first; r < first + count; ++r) {
        const int64_t at = segment_scale_index(first, count, tiles, r, t);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, rows * tiles);
        // CUTLASS's MN-major block: rows contiguous, tile t after t whole columns of the segment.
        if (r > first) EXPECT_EQ(at, segment_scale_index(first, count, tiles, r - 1, t) + 1);
        if (r == first && t > 0) EXPECT_EQ(at, segment_scale_index(first, count, tiles, r, t - 1) + count);
        if (r == first && t == 0) EXPECT_EQ(at, first * tiles) << "the block must start where the GEMM looks";
        ++hits[at];
      }
  }
  for (int64_t i = 0; i < rows * tiles; ++i) EXPECT_EQ(hits[i], 1) << "slot " << i;
}

TEST(Fp8Scales, TransposedSegmentsAreAlignedAndDisjointForAnyCounts) {
  // Random contiguous segments (empty ones, 1-row ones, long ones) from a random first row: each
  // starts on a 16-column boundary, the columns and 128-row scale blocks of no two overlap, and
  // all lie within transposed_pitch / transposed_blocks of the rows.
  std::mt19937_64 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    const int segments = 1 + int(rng() % 40);
    std::vector<int64_t> offsets = {int64_t(rng() % 300)};
    for (int s = 0; s < segments; ++s) {
      const int kind = int(rng() % 4);
      offsets.push_back(offsets.back() + (kind == 0 ? 0 : kind == 1 ? 1 : int64_t(rng() % (kind == 2 ? 130 : 1000))));
    }
    const int64_t rows = offsets.back() + int64_t(rng() % 50);
    std::vector<int> columns(transposed_pitch(rows, segments), 0), blocks(transposed_blocks(rows, segments), 0);
    for (int s = 0; s < segments; ++s) {
      const int64_t first = offsets[s], count = offsets[s + 1] - first;
      const int64_t c0 = transposed_column(first, s), b0 = transposed_block(first, s);
      ASSERT_EQ(c0 % 16, 0);
      ASSERT_LE(c0 + count, int64_t(columns.size())) << "trial " << trial << " segment " << s;
      ASSERT_LE(b0 + fp8_tiles(count, 128), int64_t(blocks.size())) << "trial " << trial << " segment " << s;
      for (int64_t c = c0; c < c0 + count; ++c) ASSERT_EQ(++columns[c], 1) << "column " << c << " taken twice";
      for (int64_t b = b0; b < b0 + fp8_tiles(count, 128); ++b) ASSERT_EQ(++blocks[b], 1) << "block " << b;
    }
  }
}
