#include "cpu/fp8_gemm.hpp"

#include <algorithm>
#include <array>
#include <cmath>

#include "cpu/parallel.hpp"

namespace moka::cpu {
namespace {

const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = core::e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

}  // namespace

template <typename In>
Fp8Matrix Fp8Matrix::quantize(const In* x, int64_t rows, int64_t cols, int64_t tile_rows, int64_t ld) {
  Fp8Matrix q{rows, cols, tile_rows, std::vector<uint8_t>(rows * cols),
              std::vector<float>(core::fp8_tiles(rows, tile_rows) * core::fp8_tiles(cols, core::kFp8TileCols))};
  core::quantize_tiles(x, rows, cols, ld > 0 ? ld : cols, tile_rows, q.codes.data(), q.scales.data());
  return q;
}

template <typename In>
Fp8Matrix Fp8Matrix::quantize_transposed(const In* x, int64_t rows, int64_t cols, int64_t tile_rows) {
  std::vector<In> transposed(cols * rows);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) transposed[c * rows + r] = x[r * cols + c];
  return quantize(transposed.data(), cols, rows, tile_rows);
}

template <typename In>
Fp8Matrix Fp8Matrix::quantize_columns(const std::vector<int64_t>& rows, const In* x, int64_t width,
                                      const In* row_scale) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<In> transposed(width * n);
  for (int64_t j = 0; j < n; ++j) {
    const In* row = x + rows[j] * width;
    for (int64_t c = 0; c < width; ++c) transposed[c * n + j] = row_scale ? row_scale[rows[j]] * row[c] : row[c];
  }
  return quantize(transposed.data(), width, n, core::kFp8RowTileRows);
}

float fp8_promoted_dot(const Fp8Matrix& a, int64_t m, const Fp8Matrix& b, int64_t n, float acc) {
  const auto& value = e4m3_values();
  const uint8_t* ar = a.codes.data() + m * a.cols;
  const uint8_t* br = b.codes.data() + n * b.cols;
  for (int64_t t = 0; t < a.col_tiles(); ++t) {
    const int64_t k0 = t * core::kFp8TileCols, k1 = std::min(a.cols, k0 + core::kFp8TileCols);
    double partial = 0;
    for (int64_t k = k0; k < k1; ++k) partial += static_cast<double>(value[ar[k]] * value[br[k]]);
    acc = std::fma(static_cast<float>(partial), a.scale(m, t) * b.scale(n, t), acc);
  }
  return acc;
}

template <typename Out>
void fp8_gemm(const Fp8Matrix& a, const Fp8Matrix& b, Out* c, int threads) {
  parallel_for(a.rows, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m)
      for (int64_t n = 0; n < b.rows; ++n) c[m * b.rows + n] = static_cast<Out>(fp8_promoted_dot(a, m, b, n));
  });
}

template Fp8Matrix Fp8Matrix::quantize(const float*, int64_t, int64_t, int64_t, int64_t);
template Fp8Matrix Fp8Matrix::quantize(const double*, int64_t, int64_t, int64_t, int64_t);
template Fp8Matrix Fp8Matrix::quantize_transposed(const float*, int64_t, int64_t, int64_t);
template Fp8Matrix Fp8Matrix::quantize_transposed(const double*, int64_t, int64_t, int64_t);
template Fp8Matrix Fp8Matrix::quantize_columns(const std::vector<int64_t>&, const float*, int64_t, const float*);
template Fp8Matrix Fp8Matrix::quantize_columns(const std::vector<int64_t>&, const double*, int64_t, const double*);
template void fp8_gemm(const Fp8Matrix&, const Fp8Matrix&, float*, int);
template void fp8_gemm(const Fp8Matrix&, const Fp8Matrix&, double*, int);

}  // namespace moka::cpu
