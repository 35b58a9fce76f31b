// The consumers' bf16 stores of a tile's fp32 accumulator straight into global rows (no shared
// memory box, no TMA): the forward's g and u by slot and the backward's epilogues.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/megakernel/tile_gemm.cuh"

namespace moka::cuda::mk {

// Where a tile's outputs go: rows [row0, row0 + valid_rows) and columns [col0, col0 + N) of
// row-major buffers `width` columns wide (columns past it are the last tile's overhang).
struct TileOut {
  int64_t row0, valid_rows, col0, width;
};

// ---- Runs: the accumulator's bf16 rows in 8-byte accesses ------------------------------------

// The wgmma layout gives the thread of quad lane q (lane % 4) the columns 2q, 2q + 1 of each
// 8-column block of its rows, element i + 4 sitting 8 columns right of element i and element
// i + 2 8 rows below it. Two blocks side by side are 16 columns of a row that one quad holds:
// after one shuffle with its partner lane q ^ 1, each thread holds a run of 4 consecutive ones
// (even q: columns 2q..2q+3 of the first block, odd q: columns 2q-2..2q+1 of the second), so a
// quad reads or writes a full 32-byte sector of a bf16 row with one 8-byte access per thread.
static_assert(AccumulatorToTile{}(0, 1) == AccumulatorToTile{}(0, 0) + kTileM &&
                  AccumulatorToTile{}(0, 2) == AccumulatorToTile{}(0, 0) + 8 &&
                  AccumulatorToTile{}(0, 4) == AccumulatorToTile{}(0, 0) + 8 * kTileM &&
                  AccumulatorToTile{}(5, 8) == AccumulatorToTile{}(5, 0) + 16 * kTileM,
              "the runs assume the m64nNk16 accumulator layout");

__device__ inline int quad_lane() { return int(threadIdx.x % 4); }

// The first column of this thread's run within the 16 columns of two blocks.
__device__ inline int run_column() {
  const int q = quad_lane();
  return q & 1 ? 2 * q + 6 : 2 * q;
}

__device__ inline uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return reinterpret_cast<const uint32_t&>(pair);
}

// lo, hi: this thread's bf16 pairs of the first and the second block. Every lane of the warp
// calls it (a shuffle).
__device__ inline uint2 to_run(uint32_t lo, uint32_t hi) {
  const bool odd = quad_lane() & 1;
  const uint32_t partner = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 1);
  return odd ? make_uint2(partner, hi) : make_uint2(lo, partner);
}

// The inverse of to_run: this thread's pairs of both blocks from the runs the quad loaded.
__device__ inline void from_run(uint2 run, uint32_t& lo, uint32_t& hi) {
  const bool odd = quad_lane() & 1;
  const uint32_t partner = __shfl_xor_sync(0xffffffffu, odd ? run.x : run.y, 1);
  lo = odd ? partner : run.x;
  hi = odd ? run.y : partner;
}

__device__ inline float2 bf16x2_floats(uint32_t bits) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162&>(bits));
}

// Calls fn(r, c, i, half) for each run of this thread whose elements lie in [Begin, End) (of
// 8-element groups: two blocks of both rows): row r, columns [c, c + 4); its own elements are
// i, i + 1 of the first block and i + 4, i + 5 of the second. half (0 or 1: row r is the first
// or the second of the thread's two rows) and i are constants once unrolled, for registers.
template <int Begin, int End, class Fn>
__device__ inline void for_each_run_in(Fn&& fn) {
  static_assert(Begin % 8 == 0 && End % 8 == 0 && End <= kAccumulatorSize);
  TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(consumer_thread());
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  const int shift = run_column() - 2 * quad_lane();
  CUTE_UNROLL
  for (int group = Begin; group < End; group += 8) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int i = group + 2 * half;
      const auto [r, c] = coords(i);
      fn(int(r), int(c) + shift, i, half);
    }
  }
}

// Every run in columns [0, kHalfN) of the tile (with BothHalves also [kHalfN, kTileN)).
template <bool BothHalves, class Fn>
__device__ inline void for_each_run(Fn&& fn) {
  for_each_run_in<0, BothHalves ? kAccumulatorSize : kAccumulatorSize / 2>(fn);
}

// One run of a row-major bf16 output (the run lies wholly inside or outside its width: widths
// are multiples of 8).
__device__ inline void store_run(__nv_bfloat16* base, const TileOut& o, int r, int c, uint2 run) {
  if (r >= o.valid_rows || o.col0 + c >= o.width) return;
  *reinterpret_cast<uint2*>(base + (o.row0 + r) * o.width + o.col0 + c) = run;
}

// The accumulator's columns [0, kHalfN) (BothHalves: [0, kTileN)), from element `first` on (a
// gate|up tile's up half: kAccumulatorSize / 2), rounded to bf16 into the rows of `out`.
template <bool BothHalves>
__device__ inline void store_rows(const Accumulator& acc, int first, __nv_bfloat16* out, const TileOut o) {
  for_each_run<BothHalves>([&](int r, int c, int i, int) {
    const int e = first + i;
    store_run(out, o, r, c, to_run(bf16x2_bits(acc(e), acc(e + 1)), bf16x2_bits(acc(e + 4), acc(e + 5))));
  });
}

// Where a slot's row goes (o.width columns): row `slot` of `out`, except that with `first_slots`
// the slots token * top_k + 0 go to row token of first_slots and the others, j >= 1, to row
// token * (top_k - 1) + j - 1 of `out` (the backward's d_x: slot 0 into d_x itself at EP = 1).
struct SlotTargets {
  __nv_bfloat16* out = nullptr;
  __nv_bfloat16* first_slots = nullptr;
  int32_t top_k = 1;

  __device__ __nv_bfloat16* row(int32_t slot, int64_t width) const {
    if (!first_slots) return out + slot * width;
    const int32_t token = slot / top_k, j = slot - token * top_k;  // 32-bit: no division call
    return j == 0 ? first_slots + token * width : out + (int64_t(token) * (top_k - 1) + j - 1) * width;
  }
};

// As store_rows, but row r of the tile goes to the row of slot slots[r] (its slot, token * k + j,
// or source * T*k + token * k + j), and nowhere where slots[r] < 0 (padding). Each thread's two
// rows' targets are found once; the runs are made on every lane (to_run shuffles within the quad).
template <bool BothHalves>
__device__ inline void store_slot_rows(const Accumulator& acc, int first, const SlotTargets& to, const int32_t* slots,
                                       const TileOut o) {
  __nv_bfloat16* row_of[2] = {nullptr, nullptr};
  for_each_run_in<0, 8>([&](int r, int, int, int half) {
    const int32_t slot = r < o.valid_rows ? slots[r] : -1;
    if (slot >= 0) row_of[half] = to.row(slot, o.width);
  });
  for_each_run<BothHalves>([&](int, int c, int i, int half) {
    const int e = first + i;
    const uint2 run = to_run(bf16x2_bits(acc(e), acc(e + 1)), bf16x2_bits(acc(e + 4), acc(e + 5)));
    if (row_of[half] && o.col0 + c < o.width) *reinterpret_cast<uint2*>(row_of[half] + o.col0 + c) = run;
  });
}

}  // namespace moka::cuda::mk
