// The megakernel's GEMM core: one 128 x 128 output tile of D = A B^T (A [rows, K], B [N, K],
// both K-major bf16, fp32 accumulation) computed by one CTA of two consumer warpgroups, with
// TMA loads into a kStages-deep shared-memory ring and wgmma (sm_90a) tensor-core MMAs.
//
// Why a tile function and not CUTLASS's grouped GEMM kernel: inside the megakernel a compute
// CTA takes one tile at a time from the task ticket and waits on the counters of exactly the
// rows it reads; CUTLASS's kernels own their grid and tile scheduler. The building blocks are
// CuTe's (TMA atoms, GMMA atoms, swizzled layouts), so only the tile loop is ours.
//
// Pipeline: thread 0 is also the producer. It issues the first kStages k-blocks of a tile; each
// consumed stage is refilled with the k-block kStages ahead once all 256 threads have arrived on
// the stage's `empty` barrier; one k-block of MMAs stays in flight while the next is issued.
// Stage and phase follow one running k-block count that persists across tiles, so the barriers
// are initialized once per CTA. The producer waits on every phase of every `empty` barrier
// before it refills the stage, the first loads of a tile included (the previous tile's last
// releases completed those phases), and drain_tile_pipeline waits on the last ones before the
// CTA exits: no mbarrier phase completes unobserved, which compute-sanitizer's synccheck reports
// as a missing wait. Out-of-range rows, columns and K (TMA boxes past the tensor's end) are
// zero-filled by the TMA unit.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>

#include <cstdint>

namespace moka::cuda::mk {

using namespace cute;

using Element = cutlass::bfloat16_t;
inline constexpr int kTileM = 128;
inline constexpr int kTileN = 128;
inline constexpr int kTileK = 64;
inline constexpr int kStages = 4;
inline constexpr int kThreads = 256;  // two consumer warpgroups; every CTA of the kernel has them

using SmemLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                          make_shape(Int<kTileM>{}, Int<kTileK>{}, Int<kStages>{})));
// Two warpgroups stacked along M: each computes 64 x 128 of the tile.
using TiledMma = decltype(make_tiled_mma(SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{},
                                         Layout<Shape<_2, _1, _1>>{}));

// Every operand is a 3-D K-major tensor (rows, K, batch): activations have batch 1, expert
// weights [E, N, K] have batch E. One TMA descriptor type for all of them.
inline auto operand_tensor(const Element* base, int rows, int k, int batch) {
  return make_tensor(make_gmem_ptr(base), make_shape(rows, k, batch),
                     make_stride(int64_t(k), _1{}, int64_t(rows) * k));
}
inline auto make_operand_tma(const Element* base, int rows, int k, int batch) {
  return make_tma_atom(SM90_TMA_LOAD{}, operand_tensor(base, rows, k, batch), SmemLayout{}(_, _, 0),
                       make_shape(Int<kTileM>{}, Int<kTileK>{}));
}
using TmaAtom = decltype(make_operand_tma(nullptr, 1, 1, 1));

// A TMA descriptor with the extents it was made for (the device side rebuilds the coordinate
// tensor from them).
struct Operand {
  TmaAtom tma;
  int rows = 0, k = 0, batch = 0;
};

inline Operand make_operand(const void* base, int64_t rows, int64_t k, int64_t batch) {
  return {make_operand_tma(static_cast<const Element*>(base), int(rows), int(k), int(batch)), int(rows), int(k),
          int(batch)};
}

struct TileSmem {
  alignas(1024) Element a[cosize_v<SmemLayout>];
  alignas(1024) Element b0[cosize_v<SmemLayout>];
  alignas(1024) Element b1[cosize_v<SmemLayout>];
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
};

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// Accumulator fragment of one thread for a 128 x 128 tile, and the (row, col) of each element.
using Accumulator = decltype(partition_fragment_C(TiledMma{}, Shape<Int<kTileM>, Int<kTileN>>{}));

__device__ inline void init_tile_pipeline(TileSmem& sm) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&sm.full[s], 1);
      EmptyBarrier::init(&sm.empty[s], kThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// Where one operand's tile lives: the 128-row tile index along its rows and its batch index.
struct TileCoord {
  const Operand* op;
  int row_tile;
  int batch;
};

// k-block `kb` of an operand tile, as the TMA source/destination pair for stage `stage`.
__device__ inline void issue_tma(const TileCoord& c, Element* smem, uint64_t& bar, int kb, int stage) {
  Tensor m = c.op->tma.get_tma_tensor(make_shape(c.op->rows, c.op->k, c.op->batch));
  Tensor g = local_tile(m(_, _, c.batch), Shape<Int<kTileM>, Int<kTileK>>{}, make_coord(c.row_tile, _));
  Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
  auto [tg, ts] = tma_partition(c.op->tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  copy(c.op->tma.with(bar), tg(_, kb), ts(_, stage));
}

// acc0 = A B0^T (and acc1 = A B1^T when b1 is given: the gate and up halves share A), over the
// operands' common K. `kblocks_done` is the CTA's running k-block count (same in every thread).
// One k-block of MMAs stays in flight: after issuing block kb the warpgroups wait only for block
// kb-1, release its stage, and thread 0 refills that stage with block kb-1+kStages.
__device__ inline void mma_tile(TileSmem& sm, uint32_t& kblocks_done, const TileCoord& a, const TileCoord& b0,
                                const TileCoord* b1, Accumulator& acc0, Accumulator& acc1) {
  const int k = a.op->k;
  const int kblocks = (k + kTileK - 1) / kTileK;
  const uint32_t bytes = kTileM * kTileK * sizeof(Element) * (b1 ? 3 : 2);
  auto stage_of = [&](int kb) { return int((kblocks_done + kb) % kStages); };
  auto phase_of = [&](int kb) { return uint32_t(((kblocks_done + kb) / kStages) & 1); };
  // Thread 0: waits until every thread released the stage's previous k-block, then refills it.
  auto load = [&](int kb) {
    const int stage = stage_of(kb);
    if (kblocks_done + kb >= uint32_t(kStages)) EmptyBarrier::wait(&sm.empty[stage], phase_of(kb) ^ 1u);
    FullBarrier::arrive_and_expect_tx(&sm.full[stage], bytes);
    issue_tma(a, sm.a, sm.full[stage], kb, stage);
    issue_tma(b0, sm.b0, sm.full[stage], kb, stage);
    if (b1) issue_tma(*b1, sm.b1, sm.full[stage], kb, stage);
  };
  // Stage of block kb is consumed: every thread arrives; thread 0 refills it kStages ahead.
  auto release = [&](int kb) {
    EmptyBarrier::arrive(&sm.empty[stage_of(kb)]);
    if (threadIdx.x == 0 && kb + kStages < kblocks) load(kb + kStages);
  };
  if (threadIdx.x == 0)
    for (int kb = 0; kb < kblocks && kb < kStages; ++kb) load(kb);

  TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(threadIdx.x);
  Tensor tA = thr.make_fragment_A(thr.partition_A(make_tensor(make_smem_ptr(sm.a), SmemLayout{})));
  Tensor tB0 = thr.make_fragment_B(thr.partition_B(make_tensor(make_smem_ptr(sm.b0), SmemLayout{})));
  Tensor tB1 = thr.make_fragment_B(thr.partition_B(make_tensor(make_smem_ptr(sm.b1), SmemLayout{})));
  clear(acc0);
  if (b1) clear(acc1);
  warpgroup_fence_operand(acc0);
  warpgroup_fence_operand(acc1);
  for (int kb = 0; kb < kblocks; ++kb) {
    const int stage = stage_of(kb);
    FullBarrier::wait(&sm.full[stage], phase_of(kb));
    warpgroup_fence_operand(acc0);
    warpgroup_fence_operand(acc1);
    warpgroup_arrive();
    gemm(mma, tA(_, _, _, stage), tB0(_, _, _, stage), acc0);
    if (b1) gemm(mma, tA(_, _, _, stage), tB1(_, _, _, stage), acc1);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // block kb-1's MMAs are done reading their stage
    warpgroup_fence_operand(acc0);
    warpgroup_fence_operand(acc1);
    if (kb > 0) release(kb - 1);
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc0);
  warpgroup_fence_operand(acc1);
  if (kblocks > 0) release(kblocks - 1);
  kblocks_done += kblocks;
}

// Thread 0, before the CTA exits: waits on the `empty` phases the last k-blocks completed, so
// every phase of the pipeline has been observed (all threads arrived before the CTA's last
// __syncthreads, so this returns at once).
__device__ inline void drain_tile_pipeline(TileSmem& sm, uint32_t kblocks_done) {
  if (threadIdx.x != 0) return;
  const uint32_t first = kblocks_done > uint32_t(kStages) ? kblocks_done - kStages : 0;
  for (uint32_t n = first; n < kblocks_done; ++n) EmptyBarrier::wait(&sm.empty[n % kStages], (n / kStages) & 1u);
}

// Calls fn(row, col, i) for each pair of horizontally adjacent accumulator elements this thread
// holds: acc(i) is at (row, col) of the tile and acc(i + 1) at (row, col + 1); col is even. The
// same i indexes every Accumulator alike, so a second accumulator's pair is acc2(i), acc2(i + 1).
template <class Fn>
__device__ inline void for_each_pair(const Accumulator& acc, Fn&& fn) {
  TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(threadIdx.x);
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  static_assert(decltype(size(coords))::value == decltype(size(acc))::value);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const auto [r, c] = coords(i);
    fn(int(r), int(c), i);
  }
}

// Proxy fence: generic-proxy stores of this thread become visible to later TMA (async-proxy)
// reads that are ordered after them by the counters.
__device__ inline void fence_generic_to_async() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace moka::cuda::mk
