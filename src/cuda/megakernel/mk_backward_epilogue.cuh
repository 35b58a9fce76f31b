// The backward megakernel's dgd epilogue (docs/MEGAKERNEL.md, "Backward plan"): the consumers
// hold dH = d_out . W_down for 128 rows x 256 columns of I (fp32, the GEMM core's accumulator)
// and, per element, with the saved gate g and up u of the forward (bf16):
//   h = act(g, u)                      the forward's own function on the same inputs: its bits
//   partial(row) += dH * bf16(h)       <dH, h> over the tile's columns (d_topk_weights, summed
//                                      over the column tiles later in column order)
//   (dg, du) = act'(g, u) (w dH)       core::swiglu_backward, w the row's route weight
//   hs = bf16(w bf16(h))               the A side of dW_down = d_out^T . hs
// dg, du and hs are stored as bf16 (the operands of the dx and weight-gradient GEMMs).
//
// The partial of a row is summed in a fixed order whatever the CTA: each thread adds its
// columns in ascending order, then the four threads of a quad that share the row combine by a
// fixed butterfly (the wgmma layout spreads a row's 256 columns over one quad).
#pragma once
#include <cuda_bf16.h>

#include "core/activation.hpp"
#include "cuda/megakernel/mk_compute.cuh"
#include "cuda/megakernel/mk_tile_gemm.cuh"

namespace moka::cuda::mk {

// Where a dgd tile's epilogue reads and writes: rows [row0, row0 + valid_rows) and columns
// [col0, col0 + kTileN) (clipped at `width` = I) of row-major [rows, I] buffers; one partial per
// (row, column tile) in `partials` [rows, col_tiles]. The tile's padding rows [valid_rows,
// kTileM) of dg, du and hs are written as zeros (the buffers hold whole row tiles, as the ring
// does): the weight-gradient tasks sum over whole row tiles, and a ring slot's padding rows
// would otherwise hold an earlier step's values.
struct DgdTile {
  const __nv_bfloat16 *gate, *up;
  const float* weight;  // the route weight of each row
  __nv_bfloat16 *d_gate, *d_up, *scaled_hidden;
  float* partials;
  int64_t row0, valid_rows, col0, width, col_tile, col_tiles;
  core::ActParams act;
};

// One element of the epilogue; returns dH * bf16(h), the element's term of the partial.
// Multiplications and additions are rounded separately (no FMA contraction), as on the CPU.
__device__ inline float dgd_element(float dh, float g, float u, float w, const core::ActParams& act, float& dg, float& du,
                                    float& hs) {
  const float h = __bfloat162float(__float2bfloat16_rn(core::swiglu_forward<float>(g, u, act.clamped, act.limit)));
  core::swiglu_backward<float>(g, u, __fmul_rn(w, dh), act.clamped, act.limit, dg, du);
  hs = __fmul_rn(w, h);
  return __fmul_rn(dh, h);
}

// The 256 consumer threads, after mma_tile: writes dg, du, hs and the rows' partials.
__device__ inline void store_dgd_tile(const Accumulator& acc, const DgdTile& t) {
  // Each thread holds two rows of the tile (r and r + 8 in its warp's 16-row slice).
  float partial[2] = {0.f, 0.f};
  int row_of[2] = {0, 0};
  for_each_pair<true>([&](int r, int c, int i) {
    const int slot = (r >> 3) & 1;
    row_of[slot] = r;
    const int64_t row = t.row0 + r, col = t.col0 + c;
    if (col >= t.width) return;
    const int64_t at = row * t.width + col;
    if (r >= t.valid_rows) {
      const __nv_bfloat162 zero = __floats2bfloat162_rn(0.f, 0.f);
      for (__nv_bfloat16* out : {t.d_gate, t.d_up, t.scaled_hidden}) *reinterpret_cast<__nv_bfloat162*>(out + at) = zero;
      return;
    }
    const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(t.gate + at));
    const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(t.up + at));
    const float w = t.weight[row];
    float dg0, du0, hs0, dg1, du1, hs1;
    partial[slot] = __fadd_rn(partial[slot], dgd_element(acc(i), g.x, u.x, w, t.act, dg0, du0, hs0));
    partial[slot] = __fadd_rn(partial[slot], dgd_element(acc(i + 1), g.y, u.y, w, t.act, dg1, du1, hs1));
    *reinterpret_cast<__nv_bfloat162*>(t.d_gate + at) = __floats2bfloat162_rn(dg0, dg1);
    *reinterpret_cast<__nv_bfloat162*>(t.d_up + at) = __floats2bfloat162_rn(du0, du1);
    *reinterpret_cast<__nv_bfloat162*>(t.scaled_hidden + at) = __floats2bfloat162_rn(hs0, hs1);
  });
  for (int slot = 0; slot < 2; ++slot) {
    float p = partial[slot];
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 1));
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 2));
    if (threadIdx.x % 4 == 0 && row_of[slot] < t.valid_rows)
      t.partials[(t.row0 + row_of[slot]) * t.col_tiles + t.col_tile] = p;
  }
  fence_generic_to_async();
}

// ---- Weight-gradient stores -----------------------------------------------------------------

// The gate|up weight-gradient tile computes x^T [dg | du] (M = H; the left 128 columns are I
// columns of dW_gate, the right ones of dW_up), and dW_gate, dW_up are [I, H]: each half is
// stored transposed, tile element (r, c) at row col0 + c, column row0 + r of a row-major
// [cols, rows] matrix (rows = H, cols = I), as bf16. Scalar stores: the 8 quads of a warp
// write 8 consecutive elements of each destination row.
__device__ inline void store_transposed_halves(const Accumulator& acc, __nv_bfloat16* left, __nv_bfloat16* right,
                                               int64_t row0, int64_t col0, int64_t rows, int64_t cols) {
  constexpr int half = kAccumulatorSize / 2;
  for_each_pair<false>([&](int r, int c, int i) {
    const int64_t row = row0 + r;
    if (row >= rows) return;
    for (int j = 0; j < 2; ++j) {
      const int64_t col = col0 + c + j;
      if (col >= cols) return;
      left[col * rows + row] = __float2bfloat16_rn(acc(i + j));
      right[col * rows + row] = __float2bfloat16_rn(acc(half + i + j));
    }
  });
}

// ---- Weight-gradient carries -------------------------------------------------------------

// A weight gradient whose expert's rows straddle a macrobatch boundary is summed in segments:
// each segment but the last leaves its fp32 accumulator in the carry buffer (the tile's
// elements of a row-major matrix, `o.width` = the matrix's columns), the next reloads it and
// continues (mma_tile's continue_acc). Elements outside the matrix are neither stored nor
// loaded (they stay zero: their operands are zero-filled).
__device__ inline void store_carry(const Accumulator& acc, float* carry, const TileOut& o) {
  for_each_pair<true>([&](int r, int c, int i) {
    if (r >= o.valid_rows || o.col0 + c >= o.width) return;
    *reinterpret_cast<float2*>(carry + (o.row0 + r) * o.width + o.col0 + c) = make_float2(acc(i), acc(i + 1));
  });
}

__device__ inline void load_carry(Accumulator& acc, const float* carry, const TileOut& o) {
  clear(acc);
  for_each_pair<true>([&](int r, int c, int i) {
    if (r >= o.valid_rows || o.col0 + c >= o.width) return;
    const float2 v = *reinterpret_cast<const float2*>(carry + (o.row0 + r) * o.width + o.col0 + c);
    acc(i) = v.x;
    acc(i + 1) = v.y;
  });
}

}  // namespace moka::cuda::mk
