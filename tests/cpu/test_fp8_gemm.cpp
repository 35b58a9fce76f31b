// The reference FP8 GEMM (cpu/fp8_gemm.hpp) against fp64 on its dequantized inputs, what the
// promotion every 128 of K buys over a whole-K low-precision accumulator, and the weight
// quantization in both orientations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/expert_math.hpp"
#include "cpu/fp8_gemm.hpp"

using namespace moka;
using namespace moka::cpu;

namespace {

// Rows whose magnitudes differ by up to 2^±8 from row to row (so tiles get different scales).
std::vector<float> random_rows(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-8.0f, 8.0f);
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float magnitude = std::exp2(exponent(rng));
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = normal(rng) * magnitude;
  }
  return x;
}

std::vector<double> dequantized(const Fp8Matrix& m) {
  std::vector<double> v(m.rows * m.cols);
  core::dequantize_tiles(m.codes.data(), m.scales.data(), m.rows, m.cols, m.tile_rows, v.data());
  return v;
}

// Row m of a times row n of b in fp64, and sum_k |a_k b_k|, over rows of K values.
struct Fp64Dot {
  double value = 0, magnitude = 0;
};
Fp64Dot fp64_dot(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n, int64_t K) {
  Fp64Dot d;
  for (int64_t k = 0; k < K; ++k) {
    d.value += a[m * K + k] * b[n * K + k];
    d.magnitude += std::abs(a[m * K + k] * b[n * K + k]);
  }
  return d;
}

}  // namespace

// C = A B^T against the fp64 product of the dequantized operands (exact here: every product of
// an e4m3 value and a scale is a double, and K < 2^20 terms of them sum within K * 2^-53 of it).
// Each 128-block's partial is exact, then three fp32 roundings per block (the partial, the scale
// product, the FMA into the accumulator), so |C - C64| <= (blocks + 2) * 2^-24 * sum_k |a_k b_k|
// up to second order: the bound checked, element by element.
class Fp8Gemm : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, int64_t>> {};

TEST_P(Fp8Gemm, MatchesFp64OnTheDequantizedInputs) {
  const auto [M, N, K, b_tile_rows] = GetParam();
  const auto a_values = random_rows(M, K, 11 + K), b_values = random_rows(N, K, 12 + K);
  const auto a = Fp8Matrix::quantize(a_values.data(), M, K, core::kFp8RowTileRows);
  const auto b = Fp8Matrix::quantize(b_values.data(), N, K, b_tile_rows);
  std::vector<float> c(M * N);
  fp8_gemm(a, b, c.data(), 3);
  const auto ad = dequantized(a), bd = dequantized(b);
  const double blocks = double(core::fp8_tiles(K, core::kFp8TileCols));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const auto [exact, magnitude] = fp64_dot(ad, bd, m, n, K);
      const double bound = (blocks + 2) * std::ldexp(magnitude, -24) * (1 + 1e-6) + K * std::ldexp(magnitude, -53);
      ASSERT_LE(std::abs(c[m * N + n] - exact), bound) << m << "," << n;
    }
}

// (M, N, K, B's tile rows): 128 = weights in blocks (forward, dgrad), 1 = the wgrad's two
// 1x128-quantized operands. K and the row counts off the tile multiples, and K = 16384 + 37.
INSTANTIATE_TEST_SUITE_P(Shapes, Fp8Gemm,
                         ::testing::Values(std::make_tuple(5, 7, 300, 128), std::make_tuple(3, 130, 257, 128),
                                           std::make_tuple(2, 3, 128, 128), std::make_tuple(4, 5, 1, 128),
                                           std::make_tuple(3, 4, 16421, 128), std::make_tuple(7, 9, 200, 1),
                                           std::make_tuple(2, 2, 16384, 1)));

TEST(Fp8Gemm, NoKGivesZeros) {
  const auto a = Fp8Matrix::quantize<float>(nullptr, 3, 0, 1), b = Fp8Matrix::quantize<float>(nullptr, 2, 0, 128);
  std::vector<double> c(6, 1.0);
  fp8_gemm(a, b, c.data(), 2);
  for (double v : c) EXPECT_EQ(v, 0.0);
}

TEST(Fp8Gemm, SameBitsOnAnyThreadCount) {
  const auto av = random_rows(37, 300, 1), bv = random_rows(29, 300, 2);
  const auto a = Fp8Matrix::quantize(av.data(), 37, 300, 1), b = Fp8Matrix::quantize(bv.data(), 29, 300, 128);
  std::vector<float> c1(37 * 29), c4(37 * 29);
  fp8_gemm(a, b, c1.data(), 1);
  fp8_gemm(a, b, c4.data(), 4);
  EXPECT_EQ(0, std::memcmp(c1.data(), c4.data(), c1.size() * sizeof(float)));
}

namespace {

// A model of an FP8 tensor-core accumulator (Hopper keeps about 14 significant bits when it adds
// FP8 products, DeepSeek-V3 section 3.3.2): every addition rounded toward zero to 14 bits.
float accumulate_14_bits(float acc, float term) {
  uint32_t u;
  const float sum = acc + term;
  std::memcpy(&u, &sum, sizeof u);
  u &= ~((1u << 10) - 1);
  float out;
  std::memcpy(&out, &u, sizeof out);
  return out;
}

// One element of A B^T on that accumulator: promoted (each 128-block's partial goes into an fp32
// accumulator with its scales, as the recipe does) or not (the whole K of scaled products in the
// tensor core's accumulator).
double low_precision_dot(const Fp8Matrix& a, const Fp8Matrix& b, int64_t m, int64_t n, bool promoted) {
  float acc = 0, partial = 0;
  for (int64_t k = 0; k < a.cols; ++k) {
    const int64_t t = k / core::kFp8TileCols;
    const float product = core::e4m3_to_float(a.codes[m * a.cols + k]) * core::e4m3_to_float(b.codes[n * b.cols + k]);
    if (!promoted) {
      acc = accumulate_14_bits(acc, product * (a.scale(m, t) * b.scale(n, t)));
      continue;
    }
    partial = accumulate_14_bits(partial, product);
    if (k + 1 == a.cols || (k + 1) % core::kFp8TileCols == 0) {
      acc = std::fma(partial, a.scale(m, t) * b.scale(n, t), acc);
      partial = 0;
    }
  }
  return acc;
}

}  // namespace

// K = 16384: promoting every 128 of K into fp32 keeps the low-precision accumulator's error to
// 128 additions' worth (0.2% here, of the terms' rms magnitude * sqrt(K)); accumulating all of K
// there loses more than the result (114% here; DeepSeek-V3 measured ~2% at K = 4096 on H800).
// Bound: 1e-2, between the two. The reference GEMM itself is within 1e-6.
TEST(Fp8Gemm, PromotionEvery128BoundsTheAccumulationErrorAtLargeK) {
  const int64_t M = 4, N = 4, K = 16384;
  const auto av = random_rows(M, K, 21), bv = random_rows(N, K, 22);
  const auto a = Fp8Matrix::quantize(av.data(), M, K, 1), b = Fp8Matrix::quantize(bv.data(), N, K, 128);
  const auto ad = dequantized(a), bd = dequantized(b);
  std::vector<double> reference(M * N);
  fp8_gemm(a, b, reference.data(), 1);
  double worst_reference = 0, worst_promoted = 0, worst_unpromoted = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const auto [exact, magnitude] = fp64_dot(ad, bd, m, n, K);
      // Relative to the terms' magnitude: sums of random signs cancel, their errors do not.
      const auto error = [&](double v) { return std::abs(v - exact) / (magnitude / std::sqrt(double(K))); };
      worst_reference = std::max(worst_reference, error(reference[m * N + n]));
      worst_promoted = std::max(worst_promoted, error(low_precision_dot(a, b, m, n, true)));
      worst_unpromoted = std::max(worst_unpromoted, error(low_precision_dot(a, b, m, n, false)));
    }
  EXPECT_LT(worst_reference, 1e-6);
  EXPECT_LT(worst_promoted, 1e-2);
  EXPECT_GT(worst_unpromoted, 1e-2);
  RecordProperty("promoted_error", std::to_string(worst_promoted));
  RecordProperty("unpromoted_error", std::to_string(worst_unpromoted));
}

// 128x128 blocks are symmetric under transposition, so the dgrad's W^T quantized on its own is
// the transpose of W's quantization, code for code: one pass can write both orientations.
TEST(Fp8Gemm, TransposedWeightBlocksAreTheTransposedQuantization) {
  const int64_t N = 200, K = 300;
  const auto w = random_rows(N, K, 9);
  const auto q = Fp8Matrix::quantize(w.data(), N, K, core::kFp8BlockRows);
  const auto t = Fp8Matrix::quantize_transposed(w.data(), N, K, core::kFp8BlockRows);
  ASSERT_EQ(t.rows, K);
  ASSERT_EQ(t.cols, N);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) ASSERT_EQ(t.codes[k * N + n], q.codes[n * K + k]) << n << "," << k;
  for (int64_t bn = 0; bn < 2; ++bn)
    for (int64_t bk = 0; bk < 3; ++bk) EXPECT_EQ(t.scales[bk * 2 + bn], q.scales[bn * 3 + bk]);
}

// The wgrad operands: listed rows transposed (optionally scaled per row), tiles along the rows.
TEST(Fp8Gemm, QuantizedColumnsAreTheScaledTransposeOfTheListedRows) {
  const int64_t rows = 300, width = 5;
  const auto x = random_rows(rows, width, 4);
  std::vector<float> weight(rows);
  for (int64_t r = 0; r < rows; ++r) weight[r] = 0.25f + r / 512.0f;
  std::vector<int64_t> listed;
  for (int64_t r = rows - 1; r >= 0; r -= 2) listed.push_back(r);
  const auto q = Fp8Matrix::quantize_columns(listed, x.data(), width, weight.data());
  std::vector<float> expected(width * listed.size());
  for (size_t j = 0; j < listed.size(); ++j)
    for (int64_t c = 0; c < width; ++c) expected[c * listed.size() + j] = weight[listed[j]] * x[listed[j] * width + c];
  const auto direct = Fp8Matrix::quantize(expected.data(), width, int64_t(listed.size()), 1);
  EXPECT_EQ(q.codes, direct.codes);
  EXPECT_EQ(q.scales, direct.scales);
}

// The gate|up dgrad accumulates dG's blocks and then dU's into one fp32 accumulator: with I a
// multiple of 128 that is exactly one GEMM over K = 2I of [dG | dU] and [W_gate^T | W_up^T].
TEST(Fp8Gemm, GateUpDgradIsOneGemmOverBothHalves) {
  const int64_t H = 130, I = 256;
  const auto gate = random_rows(I, H, 31), up = random_rows(I, H, 32), down = random_rows(H, I, 33);
  const auto dg = random_rows(1, I, 34), du = random_rows(1, I, 35);
  const auto expert = Fp8Expert::of(ExpertWeights<float>{gate.data(), up.data(), down.data(), H, I});
  std::vector<float> dx(H);
  expert.gate_up_dgrad(dg.data(), du.data(), dx.data());

  std::vector<float> a(2 * I), b(H * 2 * I);
  std::copy(dg.begin(), dg.end(), a.begin());
  std::copy(du.begin(), du.end(), a.begin() + I);
  const auto concatenated = Fp8Matrix::quantize(a.data(), 1, 2 * I, 1);
  Fp8Matrix weights{H, 2 * I, core::kFp8BlockRows, std::vector<uint8_t>(H * 2 * I), {}};
  for (int64_t c = 0; c < H; ++c) {
    std::copy_n(&expert.gate_t.codes[c * I], I, &weights.codes[c * 2 * I]);
    std::copy_n(&expert.up_t.codes[c * I], I, &weights.codes[c * 2 * I + I]);
  }
  const int64_t blocks = I / 128;
  for (int64_t bn = 0; bn < core::fp8_tiles(H, 128); ++bn) {
    for (int64_t bk = 0; bk < blocks; ++bk) weights.scales.push_back(expert.gate_t.scales[bn * blocks + bk]);
    for (int64_t bk = 0; bk < blocks; ++bk) weights.scales.push_back(expert.up_t.scales[bn * blocks + bk]);
  }
  std::vector<float> one_gemm(H);
  fp8_gemm(concatenated, weights, one_gemm.data(), 1);
  EXPECT_EQ(0, std::memcmp(dx.data(), one_gemm.data(), H * sizeof(float)));
}
