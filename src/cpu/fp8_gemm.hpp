// The reference FP8 GEMM of the FP8 recipe (docs/FP8.md): C = A B^T with both operands quantized
// to e4m3 in core/fp8.hpp's tiles, fp32 accumulation promoted every 128 elements of K.
//
// Operands are [rows, K] with their tiles along K. Which dimension is K for each GEMM of the layer:
//   forward  gate|up: A = x rows [rows, H] (1x128),  B = W_gate, W_up [I, H] (128x128);   K = H
//            down:    A = h rows [rows, I] (1x128),  B = W_down [H, I] (128x128);         K = I
//   dgrad    down:    A = d_out rows [rows, H],      B = W_down^T [I, H] (128x128);       K = H
//            gate|up: A = dG, dU rows [rows, I],     B = W_gate^T, W_up^T [H, I];        K = I
//                     (one accumulator: dG's blocks, then dU's)
//   wgrad    dW_gate = dG^T x, dW_up = dU^T x: A = dG^T, dU^T [I, n], B = x^T [H, n];    K = n
//            dW_down = d_out^T (w h):          A = d_out^T [H, n], B = (w h)^T [I, n];   K = n
// where n counts an expert's rows in canonical order: the wgrad operands are the transposed
// ("K-major") copies of the activations and gradients, quantized 1x128 along the rows, not the
// rows' own tiles (which run along H or I).
#pragma once
#include <cstdint>
#include <vector>

#include "core/fp8.hpp"

namespace moka::cpu {

// A quantized matrix [rows, cols], cols being the GEMM's K; codes and scales in core/fp8.hpp's
// layouts (tile_rows 1: row tiles, 128: weight blocks).
struct Fp8Matrix {
  int64_t rows = 0, cols = 0, tile_rows = core::kFp8RowTileRows;
  std::vector<uint8_t> codes;
  std::vector<float> scales;

  // x [rows, cols] row-major with leading dimension ld (0: cols).
  template <typename In>
  static Fp8Matrix quantize(const In* x, int64_t rows, int64_t cols, int64_t tile_rows, int64_t ld = 0);
  // x^T for x [rows, cols] row-major: the [cols, rows] matrix quantized in tile_rows x 128 tiles
  // (weights for the dgrad; in 128x128 blocks it equals the transpose of x's own quantization).
  template <typename In>
  static Fp8Matrix quantize_transposed(const In* x, int64_t rows, int64_t cols, int64_t tile_rows);
  // The K-major copy of the listed rows of x [*, width]: [width, rows.size()], its row c holding
  // column c of the listed rows in their order, times row_scale[r] when given (computed in In),
  // quantized 1x128 along the rows: a wgrad operand.
  template <typename In>
  static Fp8Matrix quantize_columns(const std::vector<int64_t>& rows, const In* x, int64_t width,
                                    const In* row_scale = nullptr);

  int64_t col_tiles() const { return core::fp8_tiles(cols, core::kFp8TileCols); }
  float scale(int64_t row, int64_t col_tile) const { return scales[(row / tile_rows) * col_tiles() + col_tile]; }
};

// sum_k A[m, k] B[n, k] as the recipe's GEMM computes it, added to `acc`: for each 128-wide block
// of K in order, the block's sum of code-value products (exact: a product of two e4m3 values has
// at most 8 significant bits and 128 of them sum exactly in double), rounded to fp32 and added as
// acc = fma(partial, scale_a * scale_b, acc) in fp32 (scale_a * scale_b rounded to fp32 first).
// The GPU's tensor cores may round inside a block (Hopper keeps about 14 bits there); this is
// the exact form the kernels are measured against. a.cols == b.cols.
float fp8_promoted_dot(const Fp8Matrix& a, int64_t m, const Fp8Matrix& b, int64_t n, float acc = 0.0f);

// C [a.rows, b.rows] row-major = A B^T, each element one fp8_promoted_dot (rows of C split over
// `threads`; the same bits for any count). Out: float or double (converted from the fp32 result).
template <typename Out>
void fp8_gemm(const Fp8Matrix& a, const Fp8Matrix& b, Out* c, int threads);

}  // namespace moka::cpu
