// The megakernel's GEMM core: 128 x 256 output tiles of D = A B^T (A [rows, K], B [N, K], bf16,
// fp32 accumulation) on a warp-specialized CTA, in the style of CUTLASS's sm90 cooperative
// kernel: a producer warpgroup issues TMA loads into a kStages-deep shared-memory ring and two
// consumer warpgroups each compute 64 x 256 of the tile with wgmma (sm_90a).
//
// Each operand is K-major (K contiguous: the forward's activations and weights) or MN-major (its
// rows contiguous: the backward reads W_down [H, I] as B of d_out . W_down, and the ring's rows
// as both operands of the weight gradients, K = rows), a template parameter of the loop. The
// majorness changes only CuTe types: the swizzle atom of the shared-memory tiles, the TMA box
// (an MN-major 128 x 64 tile is two 64 x 64 boxes, 128 bytes of rows each) and the wgmma's
// transpose flags; CuTe's GMMA fragments build the matching descriptors (make_gmma_desc). The
// pipeline, the barriers and the accumulator layout are the same for every combination.
//
// Why a tile loop and not CUTLASS's grouped GEMM kernel: inside the megakernel a compute CTA
// takes one task at a time from the task ticket and waits on the counters of exactly the rows
// it reads; CUTLASS's kernels own their grid and tile scheduler. The building blocks are CuTe's
// and CUTLASS's (TMA atoms, GMMA atoms, swizzled layouts, mbarriers, register reconfiguration),
// so only the loop is ours.
//
// The B side of a stage is two 128-row halves loaded by separate TMA boxes: a gate|up tile
// puts 128 gate rows and 128 up rows of the weights there (two output blocks sharing A), a down
// tile 256 consecutive rows. One m64n256k16 wgmma per k-step covers both cases; every output
// element sees the k-blocks, and the k-steps inside each, in ascending K order (as CUTLASS's
// 128 x 256 cooperative kernel, whose bits the megakernel matches).
//
// Pipeline: stage and phase follow a running k-block count that persists across tasks (the
// producer's count of loads, the consumers' count of consumed blocks: the same sequence), so
// the producer keeps loading the next task's k-blocks while the consumers finish a tile and run
// its epilogue: the ring never drains between tasks. The producer waits on every phase of every
// `empty` barrier before it refills a stage, the first loads included, and drains the last ones
// before it exits: no mbarrier phase completes unobserved (compute-sanitizer's synccheck reports
// that as a missing wait). Out-of-range rows, columns and K (TMA boxes past the tensor's end)
// are zero-filled by the TMA unit.
//
// Every mbarrier wait is bounded (wait_phase): past its bound it reports a pipeline timeout in
// the status word; once any CTA failed, an incomplete wait returns at once, so a fault ends the
// kernel instead of hanging it.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/megakernel/sync.cuh"
#include "moka/error.hpp"

namespace moka::cuda::mk {

using namespace cute;

using Element = cutlass::bfloat16_t;
inline constexpr int kTileM = 128;
inline constexpr int kHalfN = 128;  // rows of one B box: a gate|up tile's gate (or up) columns
inline constexpr int kTileN = 2 * kHalfN;
inline constexpr int kTileK = 64;
inline constexpr int kStages = 4;
inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kConsumerThreads = 2 * kWarpgroupThreads;
inline constexpr int kConsumerWarps = kConsumerThreads / 32;
// The producer warpgroup (TMA warp, scheduler warp, two idle warps) and two consumer
// warpgroups; every CTA of the kernel has them.
inline constexpr int kThreads = kWarpgroupThreads + kConsumerThreads;
// Registers per thread after reconfiguration (CUTLASS's sm90 split: 128 x 40 + 256 x 232 fits
// the 64 K register file); the consumers hold a 128-register accumulator.
inline constexpr uint32_t kProducerRegisters = 40;
inline constexpr uint32_t kConsumerRegisters = 232;

using Major = GMMA::Major;

// Shared-memory layout of operand tiles of `shape` (rows, K[, stages]), swizzled in 128-byte
// lines. K-major: CuTe's K atoms (8 rows x 64 K) stacked along the rows. MN-major: CuTe's MN
// atoms (64 rows x 8 K) stacked along K first, so that every 64-row x 64-K block is one
// contiguous 8 KB TMA box (CUTLASS's sm90 collectives order MN-major tiles the same way).
template <Major M, class Shape>
constexpr auto smem_tile_layout(Shape shape) {
  if constexpr (M == Major::K) {
    return tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, shape);
  } else if constexpr (rank(Shape{}) == 2) {
    return tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, shape, Step<_2, _1>{});
  } else {
    return tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, shape, Step<_2, _1, _3>{});
  }
}

// One 128 x 64 operand tile (what one TileCoord loads), and the stage rings of A (one tile per
// stage) and B (two tiles per stage, rows 0-127 and 128-255: the halves are consecutive in
// memory, for either majorness).
template <Major M>
using BoxLayoutOf = decltype(smem_tile_layout<M>(make_shape(Int<kTileM>{}, Int<kTileK>{})));
template <Major M>
using SmemLayoutAOf = decltype(smem_tile_layout<M>(make_shape(Int<kTileM>{}, Int<kTileK>{}, Int<kStages>{})));
template <Major M>
using SmemLayoutBOf = decltype(smem_tile_layout<M>(make_shape(Int<kTileN>{}, Int<kTileK>{}, Int<kStages>{})));
using BoxLayout = BoxLayoutOf<Major::K>;
using SmemLayoutA = SmemLayoutAOf<Major::K>;
using SmemLayoutB = SmemLayoutBOf<Major::K>;
inline constexpr int kBoxElements = kTileM * kTileK;
inline constexpr uint32_t kStageBytes = 3 * kBoxElements * sizeof(Element);  // A + two B boxes
static_assert(cosize_v<SmemLayoutAOf<Major::MN>> == cosize_v<SmemLayoutA> &&
                  cosize_v<SmemLayoutBOf<Major::MN>> == cosize_v<SmemLayoutB> &&
                  cosize_v<BoxLayoutOf<Major::MN>> == kBoxElements,
              "both majornesses fill the same stage ring");

// Two warpgroups stacked along M: each computes 64 x 256 of the tile. The majors set the
// wgmma's transpose flags; the accumulator layout does not depend on them.
template <Major MA, Major MB>
using TiledMmaOf = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<MA, MB>{}, Layout<Shape<_2, _1, _1>>{}));
using TiledMma = TiledMmaOf<Major::K, Major::K>;

// Every operand is a dense 3-D tensor (rows, K, batch): activations and ring rows have batch 1,
// expert weights have batch E. K-major: element (r, k) at r * K + k (activations [rows, K],
// weights [E, N, K]). MN-major: at k * rows + r (W_down [E, H, I] as B of d_out . W_down with
// rows = I and K = H; ring rows [R, I] as an operand of a weight gradient, rows = I, K = R).
template <Major M>
inline auto operand_tensor(const Element* base, int rows, int k, int batch) {
  if constexpr (M == Major::K) {
    return make_tensor(make_gmem_ptr(base), make_shape(rows, k, batch),
                       make_stride(int64_t(k), _1{}, int64_t(rows) * k));
  } else {
    return make_tensor(make_gmem_ptr(base), make_shape(rows, k, batch),
                       make_stride(_1{}, int64_t(rows), int64_t(rows) * k));
  }
}
template <Major M>
inline auto make_operand_tma(const Element* base, int rows, int k, int batch) {
  return make_tma_atom(SM90_TMA_LOAD{}, operand_tensor<M>(base, rows, k, batch), BoxLayoutOf<M>{},
                       make_shape(Int<kTileM>{}, Int<kTileK>{}));
}

// A TMA descriptor with the extents it was made for (the device side rebuilds the coordinate
// tensor from them).
template <Major M>
struct OperandOf {
  decltype(make_operand_tma<M>(nullptr, 1, 1, 1)) tma;
  int rows = 0, k = 0, batch = 0;
};
using Operand = OperandOf<Major::K>;

// TMA needs 16-byte aligned rows: the contiguous extent (K for K-major, rows for MN-major) must
// be a multiple of 8 bf16, and the base 16-byte aligned.
template <Major M = Major::K>
inline OperandOf<M> make_operand(const void* base, int64_t rows, int64_t k, int64_t batch) {
  const int64_t contiguous = M == Major::K ? k : rows;
  require(contiguous % 8 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0, ErrorCode::unsupported_size,
          "megakernel operand of " + std::to_string(rows) + " x " + std::to_string(k) + " (" +
              (M == Major::K ? "K" : "MN") + "-major): TMA needs the contiguous extent " + std::to_string(contiguous) +
              " to be a multiple of 8 and a 16-byte aligned base");
  return {make_operand_tma<M>(static_cast<const Element*>(base), int(rows), int(k), int(batch)), int(rows), int(k),
          int(batch)};
}

// Where one operand box lives: the 128-row tile index along its rows and its batch index.
template <Major M>
struct TileCoordOf {
  const OperandOf<M>* op;
  int row_tile;
  int batch;
};
using TileCoord = TileCoordOf<Major::K>;

// What the producer loads for one product: A's row tile and the two B boxes over the common K,
// k-blocks [kblock0, kblock0 + kblocks) of it. Products loaded one after another for the same
// tile accumulate into one accumulator (d_x = dg . W_gate + du . W_up): the consumers see only
// the total count of k-blocks.
template <Major MA, Major MB>
struct TileLoadsOf {
  TileCoordOf<MA> a;
  TileCoordOf<MB> b[2];
  int kblocks = 0;  // 0: nothing to compute (a task beyond the schedule's rows)
  int kblock0 = 0;  // a K range that starts inside the operands (a segment of an expert's rows)
};
using TileLoads = TileLoadsOf<Major::K, Major::K>;

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// Accumulator fragment of one consumer thread for a 128 x 256 tile (every majorness's).
using Accumulator = decltype(partition_fragment_C(TiledMma{}, Shape<Int<kTileM>, Int<kTileN>>{}));
static_assert(std::is_same_v<Accumulator, decltype(partition_fragment_C(TiledMmaOf<Major::MN, Major::MN>{},
                                                                        Shape<Int<kTileM>, Int<kTileN>>{}))>,
              "the epilogues assume one accumulator layout for every majorness");
inline constexpr int kAccumulatorSize = decltype(size(std::declval<Accumulator>()))::value;

struct TileSmem {
  alignas(1024) Element a[cosize_v<SmemLayoutA>];
  alignas(1024) Element b[cosize_v<SmemLayoutB>];
  alignas(8) uint64_t full[kStages];   // a stage's bytes landed (producer's expect_tx + TMA)
  alignas(8) uint64_t empty[kStages];  // a stage was read (one arrival per consumer warp)
};

// Consumer threads are numbered from 0 (the MMA partitions and the epilogue use this index).
__device__ inline int consumer_thread() { return int(threadIdx.x) - kWarpgroupThreads; }
__device__ inline bool is_consumer() { return threadIdx.x >= kWarpgroupThreads; }

// ---- Bounded mbarrier waits -------------------------------------------------------------------

// The bounds of the pipeline's waits, all derived from the layer's spin_timeout_seconds (tests
// set it short). A stage wait waits for the TMA unit or the MMAs of one k-block: spin_timeout
// plus a slack of spin_timeout clamped to [0.1 s, 1 s]. A task-queue wait includes a counter wait
// or a whole task, each bounded themselves: twice that, so the inner wait always reports first (a
// counter timeout names the counter, the more useful report; the slack's floor keeps it first
// even for a bound of nanoseconds, as the timeout tests set).
inline constexpr uint64_t kMinPipelineSlackNs = 100000000ull;
inline constexpr uint64_t kMaxPipelineSlackNs = 1000000000ull;

struct PipelineWatch {
  MegakernelControl* control;
  uint64_t stage_bound_ns, queue_bound_ns;
};

__device__ inline PipelineWatch make_watch(MegakernelControl* control, uint64_t timeout_ns) {
  const uint64_t stage = timeout_ns + min(max(timeout_ns, kMinPipelineSlackNs), kMaxPipelineSlackNs);
  return {control, stage, 2 * stage};
}

// Failed try_waits between two reads of the status word and the clock. The status word is a
// system-scope load (about a microsecond): read after every try_wait it made a thread notice a
// completed phase that much late, on every k-block the consumers waited for.
inline constexpr uint32_t kWaitPollInterval = 256;

// The task a pipeline wait belongs to, as a timeout names it (kind none: between tasks).
struct TaskSite {
  core::TaskKind kind = core::TaskKind::none;
  int64_t minibatch = -1, row_tile = 0;
};

// Waits until the mbarrier completes phase `phase` (parity). False when another CTA already
// failed or the bound passed (then this thread reports a pipeline timeout at `site`).
__device__ inline bool wait_phase(uint64_t* bar, uint32_t phase, const PipelineWatch& watch, uint64_t bound_ns,
                                  core::PipelineWait what, const TaskSite& site) {
  if (EmptyBarrier::try_wait(bar, phase)) return true;
  const uint64_t start = global_ns();
  // try_wait suspends the thread until the phase completes or a hardware-defined interval
  // passes, so the loop does not spin hot.
  for (uint32_t tries = 1; !EmptyBarrier::try_wait(bar, phase); ++tries) {
    if (tries % kWaitPollInterval != 0) continue;
    if (failed(watch.control)) return false;
    if (global_ns() - start > bound_ns) {
      core::MegakernelStatus s;
      s.code = core::StatusCode::pipeline_timeout;
      s.stage = site.kind;
      s.pipeline_wait = what;
      s.minibatch = site.minibatch;
      s.row_tile = site.row_tile;
      report(watch.control, s);
      return false;
    }
  }
  return true;
}

// ---- Task-level barriers ------------------------------------------------------------------------
//
// CUTLASS's mbarrier (`try_wait`, `arrive`) and named-barrier (`bar.sync`) wrappers are `asm
// volatile` without a "memory" clobber: the hardware orders memory at them, but the compiler may
// still move ordinary loads and stores of shared or global memory across them (it hoisted a
// queue slot's reset above the wait for its `finished` phase once; racecheck caught it). Every
// barrier a thread passes once per task or per output box goes through these wrappers, which add
// a compiler fence on the side that matters (before an arrive, after a wait); the per-k-block
// stage waits inside the MMA loop do not (fences there stop the compiler from scheduling the
// loop: the backward ran 10x slower, docs/MEGAKERNEL.md "Memory order at the barriers").
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

// An arrive that releases this thread's earlier reads and writes of the slot or buffer: none of
// them moves below it. (Moving later accesses above it is harmless, and a second fence costs: with
// fences on both sides of every task-level barrier ptxas serialized the backward's wgmma.)
__device__ __forceinline__ void arrive_ordered(uint64_t* bar) {
  compiler_fence();
  EmptyBarrier::arrive(bar);
}

// wait_phase at a task-level barrier: nothing this thread reads or writes after the wait moves
// above it.
__device__ inline bool wait_phase_ordered(uint64_t* bar, uint32_t phase, const PipelineWatch& watch, uint64_t bound_ns,
                                          core::PipelineWait what, const TaskSite& site) {
  const bool reached = wait_phase(bar, phase, watch, bound_ns, what, site);
  compiler_fence();
  return reached;
}

// The task-level named barriers: sync(group) (memory_order.cuh), a compiler fence on both sides.

__device__ inline void init_tile_pipeline(TileSmem& sm) {
  for (int s = 0; s < kStages; ++s) {
    FullBarrier::init(&sm.full[s], 1);
    EmptyBarrier::init(&sm.empty[s], kConsumerWarps);
  }
}

// ---- Producer ------------------------------------------------------------------------------

// k-block `kb` of an operand box, into the box at `smem`, completing bytes on `bar`. An
// MN-major box is two TMA instructions (CuTe's partition iterates them).
template <Major M>
__device__ inline void issue_tma(const TileCoordOf<M>& c, Element* smem, uint64_t& bar, int kb) {
  Tensor m = c.op->tma.get_tma_tensor(make_shape(c.op->rows, c.op->k, c.op->batch));
  Tensor g = local_tile(m(_, _, c.batch), Shape<Int<kTileM>, Int<kTileK>>{}, make_coord(c.row_tile, _));
  Tensor s = make_tensor(make_smem_ptr(smem), BoxLayoutOf<M>{});
  auto [tg, ts] = tma_partition(c.op->tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  copy(c.op->tma.with(bar), tg(_, kb), ts);
}

// The TMA thread: loads every k-block of one task, each into the next stage of the ring once
// the consumers released that stage's previous k-block. `loads` is its running k-block count.
// False when a wait failed (this or another CTA reported a failure): it then issues nothing more,
// and the caller issues no further task's loads either (drain_tile_pipeline waits for the ones
// in flight).
template <Major MA, Major MB>
__device__ inline bool load_tile(TileSmem& sm, uint32_t& loads, const TileLoadsOf<MA, MB>& l,
                                 const PipelineWatch& watch, const TaskSite& site) {
  for (int kb = l.kblock0; kb < l.kblock0 + l.kblocks; ++kb, ++loads) {
    const int stage = int(loads % kStages);
    if (loads >= uint32_t(kStages) && !wait_phase(&sm.empty[stage], ((loads / kStages) - 1) & 1u, watch,
                                                  watch.stage_bound_ns, core::PipelineWait::stage_free, site))
      return false;
    FullBarrier::arrive_and_expect_tx(&sm.full[stage], kStageBytes);
    issue_tma(l.a, sm.a + stage * kBoxElements, sm.full[stage], kb);
    for (int h = 0; h < 2; ++h) issue_tma(l.b[h], sm.b + (2 * stage + h) * kBoxElements, sm.full[stage], kb);
  }
  return true;
}

// Waits, bounded but even after a failure, until the TMA loads of phase `phase` of `full` have
// written shared memory. A CTA that exits with loads in flight leaves the TMA unit writing into
// shared memory the next kernel on the SM may already own.
__device__ inline void wait_loads_landed(uint64_t* full, uint32_t phase, const PipelineWatch& watch) {
  const uint64_t start = global_ns();
  while (!FullBarrier::try_wait(full, phase)) {
    if (global_ns() - start > watch.stage_bound_ns) {
      core::MegakernelStatus s;
      s.code = core::StatusCode::pipeline_timeout;
      s.pipeline_wait = core::PipelineWait::operands_landed;
      report(watch.control, s);
      return;
    }
  }
}

// The TMA thread, before it exits: waits until the last k-blocks it issued have landed (after a
// failure too), then observes the `empty` phases the consumers complete for them (returns at once
// after a failure), so every phase of the ring has been observed.
__device__ inline void drain_tile_pipeline(TileSmem& sm, uint32_t loads, const PipelineWatch& watch) {
  const uint32_t first = loads > uint32_t(kStages) ? loads - kStages : 0;
  for (uint32_t n = first; n < loads; ++n) wait_loads_landed(&sm.full[n % kStages], (n / kStages) & 1u, watch);
  for (uint32_t n = first; n < loads; ++n)
    wait_phase(&sm.empty[n % kStages], (n / kStages) & 1u, watch, watch.stage_bound_ns, core::PipelineWait::stage_free,
               TaskSite{});
}

// ---- Consumers -----------------------------------------------------------------------------

// acc = A B^T over `kblocks` k-blocks of the ring, by the 256 consumer threads. `consumed` is
// their running k-block count. One k-block of MMAs stays in flight: after issuing block kb each
// warp waits only for block kb-1 and then releases its stage (one arrival per warp, after the
// warp's own wgmma reads completed). A wait that fails (a fault already reported) still runs the
// loop, so the consumer warpgroups stay in step and reach the task's end together. MA and MB
// must be the majors of the operands the producer loaded (the forward's: both K-major).
// `continue_acc`: add to the values acc holds (a weight gradient whose rows continue an earlier
// segment's, reloaded from its fp32 carry) instead of starting from zero; the k-blocks then
// meet the same accumulator values as in one pass, so the bits are the same.
template <Major MA = Major::K, Major MB = Major::K>
__device__ inline void mma_tile(TileSmem& sm, uint32_t& consumed, int kblocks, Accumulator& acc,
                                const PipelineWatch& watch, const TaskSite& site, bool continue_acc = false) {
  auto stage_of = [&](int kb) { return int((consumed + kb) % kStages); };
  const bool signals = threadIdx.x % 32 == 0;
  auto release = [&](int kb) {
    if (signals) EmptyBarrier::arrive(&sm.empty[stage_of(kb)]);
  };
  TiledMmaOf<MA, MB> mma;
  ThrMMA thr = mma.get_thread_slice(consumer_thread());
  // GMMA descriptors of every stage (make_gmma_desc: swizzle mode and strides of the major).
  Tensor tA = thr.make_fragment_A(thr.partition_A(make_tensor(make_smem_ptr(sm.a), SmemLayoutAOf<MA>{})));
  Tensor tB = thr.make_fragment_B(thr.partition_B(make_tensor(make_smem_ptr(sm.b), SmemLayoutBOf<MB>{})));
  if (!continue_acc) clear(acc);
  warpgroup_fence_operand(acc);
  for (int kb = 0; kb < kblocks; ++kb) {
    const int stage = stage_of(kb);
    wait_phase(&sm.full[stage], ((consumed + kb) / kStages) & 1u, watch, watch.stage_bound_ns,
               core::PipelineWait::operands_landed, site);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(mma, tA(_, _, _, stage), tB(_, _, _, stage), acc);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // block kb-1's MMAs are done reading their stage
    warpgroup_fence_operand(acc);
    if (kb > 0) release(kb - 1);
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (kblocks > 0) release(kblocks - 1);
  consumed += kblocks;
}

// Calls fn(row, col, i) for each pair of horizontally adjacent accumulator elements this
// thread holds in columns [0, kHalfN) of the tile: acc(i) is at (row, col) and acc(i + 1) at
// (row, col + 1), col even. With BothHalves it also visits columns [kHalfN, kTileN).
template <bool BothHalves, class Fn>
__device__ inline void for_each_pair(Fn&& fn) {
  TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(consumer_thread());
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  static_assert(decltype(size(coords))::value == kAccumulatorSize);
  CUTE_UNROLL
  for (int i = 0; i < (BothHalves ? kAccumulatorSize : kAccumulatorSize / 2); i += 2) {
    const auto [r, c] = coords(i);
    fn(int(r), int(c), i);
  }
}

// The second half of every thread's accumulator holds the tile's columns [kHalfN, kTileN):
// element i + kAccumulatorSize / 2 sits kHalfN columns right of element i (the wgmma layout
// walks n8 column blocks last), so a gate|up tile finds up(r, c) at gate(r, c)'s index + half.
using AccumulatorToTile = decltype(TiledMma{}.get_layoutC_TV());
static_assert(AccumulatorToTile{}(0, kAccumulatorSize / 2) == AccumulatorToTile{}(0, 0) + kTileM * kHalfN,
              "the accumulator's second half must be the tile's right half");
static_assert(AccumulatorToTile{}(1, kAccumulatorSize - 1) ==
                  AccumulatorToTile{}(1, kAccumulatorSize / 2 - 1) + kTileM * kHalfN,
              "the accumulator's second half must be the tile's right half");

}  // namespace moka::cuda::mk
