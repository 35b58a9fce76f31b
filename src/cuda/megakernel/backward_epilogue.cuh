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

#include <utility>

#include "core/activation.hpp"
#include "cuda/megakernel/forward_compute.cuh"
#include "cuda/megakernel/tile_gemm.cuh"

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

// ---- The dgd epilogue ------------------------------------------------------------------------

// One element of the epilogue; returns dH * bf16(h), the element's term of the partial. Both
// directions of the activation share one sigmoid.
// Multiplications and additions are rounded separately (no FMA contraction), as on the CPU.
__device__ inline float dgd_element(float dh, float g, float u, float w, const core::ActParams& act, float& dg,
                                    float& du, float& hs) {
  const float s = core::swiglu_sigmoid<float>(g, act.clamped, act.limit);
  const float h =
      __bfloat162float(__float2bfloat16_rn(core::swiglu_forward_given<float>(g, u, s, act.clamped, act.limit)));
  core::swiglu_backward_given<float>(g, u, s, __fmul_rn(w, dh), act.clamped, act.limit, dg, du);
  hs = __fmul_rn(w, h);
  return __fmul_rn(dh, h);
}

// The TMA thread, once it issued a dgd tile's last loads (a few k-blocks before its epilogue):
// g and u of the tile's rows into L2, so that the epilogue's loads do not wait on DRAM. A hint:
// rows whose address does not suit the bulk prefetch (16-byte aligned) are left out; the size is
// a multiple of 16 bytes (widths are multiples of 8).
__device__ inline void prefetch_dgd_inputs(const DgdTile& t) {
  const int64_t columns = t.width - t.col0 < kTileN ? t.width - t.col0 : kTileN;
  const uint32_t bytes = uint32_t(columns * sizeof(__nv_bfloat16));
  for (const __nv_bfloat16* base : {t.gate, t.up})
    for (int64_t r = 0; r < t.valid_rows && r < kTileM; ++r) {
      const __nv_bfloat16* at = base + (t.row0 + r) * t.width + t.col0;
      if (reinterpret_cast<uintptr_t>(at) % 16 != 0) continue;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(bytes) : "memory");
    }
}

// The dgd epilogue over the runs of accumulator elements [Begin, Begin + kDgdBatch): first
// every run's g and u loads (all in flight together), then the arithmetic and the stores.
// The thread's two rows' route weights `w` and partials are indexed by the run's half.
inline constexpr int kDgdBatch = 32;  // elements: 8 runs, 32 registers of g and u
template <int Begin>
__device__ __forceinline__ void dgd_batch(const Accumulator& acc, const DgdTile& t, const float (&w)[2],
                                          float (&partial)[2]) {
  constexpr int kRuns = kDgdBatch / 4;
  auto run_index = [](int i) { return (i - Begin) / 8 * 2 + (i - Begin) % 8 / 2; };
  uint2 g_run[kRuns], u_run[kRuns];
  for_each_run_in<Begin, Begin + kDgdBatch>([&](int r, int c, int i, int) {
    const int k = run_index(i);
    g_run[k] = u_run[k] = make_uint2(0u, 0u);
    if (r < t.valid_rows && t.col0 + c < t.width) {
      const int64_t at = (t.row0 + r) * t.width + t.col0 + c;
      g_run[k] = *reinterpret_cast<const uint2*>(t.gate + at);
      u_run[k] = *reinterpret_cast<const uint2*>(t.up + at);
    }
  });
  for_each_run_in<Begin, Begin + kDgdBatch>([&](int r, int c, int i, int half) {
    const int k = run_index(i);
    const bool real = r < t.valid_rows;
    uint32_t g_bits[2], u_bits[2];
    from_run(g_run[k], g_bits[0], g_bits[1]);
    from_run(u_run[k], u_bits[0], u_bits[1]);
    // This thread's own columns: 2q, 2q + 1 of the first block, the same of the second.
    const int64_t own = t.col0 + c - run_column() + 2 * quad_lane();
    uint32_t dg_bits[2], du_bits[2], hs_bits[2];
    CUTE_UNROLL
    for (int b = 0; b < 2; ++b) {
      const float2 g = bf16x2_floats(g_bits[b]), u = bf16x2_floats(u_bits[b]);
      float dg0, du0, hs0, dg1, du1, hs1;
      const float p0 = dgd_element(acc(i + 4 * b), g.x, u.x, w[half], t.act, dg0, du0, hs0);
      const float p1 = dgd_element(acc(i + 4 * b + 1), g.y, u.y, w[half], t.act, dg1, du1, hs1);
      if (real && own + 8 * b < t.width) partial[half] = __fadd_rn(__fadd_rn(partial[half], p0), p1);
      dg_bits[b] = real ? bf16x2_bits(dg0, dg1) : 0u;
      du_bits[b] = real ? bf16x2_bits(du0, du1) : 0u;
      hs_bits[b] = real ? bf16x2_bits(hs0, hs1) : 0u;
    }
    // Padding rows get zeros (TileOut's valid_rows would skip them).
    const TileOut whole{t.row0, kTileM, t.col0, t.width};
    store_run(t.d_gate, whole, r, c, to_run(dg_bits[0], dg_bits[1]));
    store_run(t.d_up, whole, r, c, to_run(du_bits[0], du_bits[1]));
    store_run(t.scaled_hidden, whole, r, c, to_run(hs_bits[0], hs_bits[1]));
  });
}

// The 256 consumer threads, after mma_tile: writes dg, du, hs and the rows' partials. g and u
// come in runs (8-byte loads, a batch of runs at a time), dg, du and hs go out in runs; the
// arithmetic is per element on the thread's own accumulator elements, each row's in ascending
// column order. The epilogues take their tile by value: the job they come from lives in shared
// memory, which a global store might alias as far as the compiler knows, so a reference would
// reload its fields after each.
__device__ __forceinline__ void store_dgd_tile(const Accumulator& acc, const DgdTile t) {
  // Each thread holds two rows of the tile (r and r + 8 in its warp's 16-row slice).
  float partial[2] = {0.f, 0.f}, w[2] = {0.f, 0.f};
  int row_of[2] = {0, 0};
  for_each_run_in<0, 8>([&](int r, int, int, int half) {
    row_of[half] = r;
    if (r < t.valid_rows) w[half] = t.weight[t.row0 + r];
  });
  // Forced inline: left to the inliner (whose budget the kernel's size sets), the lambda became a
  // call that took the accumulator through local memory and serialized the wgmma.
  [&]<int... Batch>(std::integer_sequence<int, Batch...>) __attribute__((always_inline)) {
    (dgd_batch<Batch * kDgdBatch>(acc, t, w, partial), ...);
  }
  (std::make_integer_sequence<int, kAccumulatorSize / kDgdBatch>{});
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    float p = partial[half];
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 1));
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 2));
    if (threadIdx.x % 4 == 0 && row_of[half] < t.valid_rows)
      t.partials[(t.row0 + row_of[half]) * t.col_tiles + t.col_tile] = p;
  }
  fence_proxy_async_global();
}

// ---- Weight-gradient stores -----------------------------------------------------------------

// An 8 x 8 bf16 block transposed across the warp (movmatrix): in, the thread's pair of row
// lane / 4, columns 2q, 2q + 1; out, the same places of the transposed block.
__device__ inline uint32_t transpose_block(uint32_t pair) {
  uint32_t t;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(t) : "r"(pair));
  return t;
}

// The gate|up weight-gradient tile computes x^T [dg | du] (M = H; the left 128 columns are I
// columns of dW_gate, the right ones of dW_up), and dW_gate, dW_up are [I, H]: each half is
// stored transposed, tile element (r, c) at row col0 + c, column row0 + r of a row-major
// [cols, rows] matrix (rows = H, a multiple of 8; cols = I), as bf16. Each 8 x 8 block is
// transposed in registers; the two blocks of a thread's rows r and r + 8 then make runs along
// H: a quad writes 32 bytes of a destination row.
__device__ __forceinline__ void store_transposed_halves(const Accumulator& acc, __nv_bfloat16* left,
                                                        __nv_bfloat16* right, int64_t row0, int64_t col0, int64_t rows,
                                                        int64_t cols) {
  constexpr int half = kAccumulatorSize / 2;
  TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(consumer_thread());
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  const int lane_row = int(threadIdx.x % 32) / 4;
  CUTE_UNROLL
  for (int i = 0; i < half; i += 4) {
    // Elements i, i + 1 (row r) and i + 2, i + 3 (row r + 8) of one 8-column block.
    const auto [r, c] = coords(i);
    const int64_t row = row0 + int(r) - lane_row + run_column();     // the run's first H index
    const int64_t col = col0 + int(c) - 2 * quad_lane() + lane_row;  // the destination row (I)
    const bool inside = row < rows && col < cols;
    CUTE_UNROLL
    for (int side = 0; side < 2; ++side) {
      const int e = i + side * half;
      const uint2 run = to_run(transpose_block(bf16x2_bits(acc(e), acc(e + 1))),
                               transpose_block(bf16x2_bits(acc(e + 2), acc(e + 3))));
      if (inside) *reinterpret_cast<uint2*>((side == 0 ? left : right) + col * rows + row) = run;
    }
  }
}

// ---- Weight-gradient carries -------------------------------------------------------------

// A weight gradient whose expert's rows straddle a macrobatch boundary is summed in segments:
// each segment but the last leaves its fp32 accumulator in the carry buffer (the tile's
// elements of a row-major matrix, `o.width` = the matrix's columns), the next reloads it and
// continues (mma_tile's continue_acc). Elements outside the matrix are neither stored nor
// loaded (they stay zero: their operands are zero-filled).
__device__ inline void store_carry(const Accumulator& acc, float* carry, const TileOut o) {
  for_each_pair<true>([&](int r, int c, int i) {
    if (r >= o.valid_rows || o.col0 + c >= o.width) return;
    *reinterpret_cast<float2*>(carry + (o.row0 + r) * o.width + o.col0 + c) = make_float2(acc(i), acc(i + 1));
  });
}

__device__ inline void load_carry(Accumulator& acc, const float* carry, const TileOut o) {
  clear(acc);
  for_each_pair<true>([&](int r, int c, int i) {
    if (r >= o.valid_rows || o.col0 + c >= o.width) return;
    const float2 v = *reinterpret_cast<const float2*>(carry + (o.row0 + r) * o.width + o.col0 + c);
    acc(i) = v.x;
    acc(i + 1) = v.y;
  });
}

}  // namespace moka::cuda::mk
