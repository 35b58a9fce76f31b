// The megakernel's communication role: dispatch pulls scheduled token rows from their owner's
// symmetric x over NVLink into the ring buffer (zero-filling padding rows); combine pushes
// expert output rows from the ring into the origin rank's combine buffer at slot token*k + j.
// One task is a block of tile_m rows. One thread moves them with TMA bulk copies, global ->
// shared -> global, one row per copy, through stages of the CTA's dynamic shared memory (up to
// kMaxCommStages rows in flight, ~190 KB): the copies are latency-bound (a ~1.3 us NVLink round
// trip), and the copy engine keeps far more bytes in flight per SM than register copies did, so
// a few CTAs carry what 16 carried. The other warps zero-fill padding rows.
//
// Memory order: bulk copies are async-proxy operations. A task's reads of rows other CTAs wrote
// (ring y, combine) follow the acquire and proxy fence of its counter wait (mk_sync.cuh). Before
// the task's release, the issuing thread waits for its copies to complete (`wait_group 0`, not
// the `.read` variant: the writes must have landed) and runs `fence.proxy.async.global`, as do
// the threads that stored padding zeros. Nothing here uses non-coherent loads (ring y is
// written in this kernel).
#pragma once
#include <cstdint>

#include "core/megakernel_plan.hpp"
#include "cuda/megakernel/megakernel_launch.hpp"
#include "cuda/megakernel/mk_sync.cuh"
#include "cuda/megakernel/mk_tile_gemm.cuh"

namespace moka::cuda::mk {

inline constexpr int kMaxCommStages = 32;

// The copy pipeline of a communication CTA (only its thread 0 touches it after init): stage s
// of the dynamic shared memory holds one row, and full[s] completes when its bulk load landed.
struct CommPipeline {
  uint64_t full[kMaxCommStages];
  uint32_t parity;  // bit s: the phase stage s completes next
  int stages;
  char* base;
};

__device__ inline CommPipeline& comm_pipeline() {
  __shared__ CommPipeline pipe;
  return pipe;
}

// Called once by every thread of a communication CTA before its task loop.
__device__ inline void init_comm_pipeline(const MegakernelLaunch& p) {
  extern __shared__ char comm_smem_raw[];
  if (threadIdx.x == 0) {
    CommPipeline& pipe = comm_pipeline();
    uint32_t dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    const uintptr_t raw = reinterpret_cast<uintptr_t>(comm_smem_raw);
    const uintptr_t base = (raw + kCommStageAlign - 1) & ~uintptr_t(kCommStageAlign - 1);
    const int64_t fit = (int64_t(dynamic_bytes) - int64_t(base - raw)) / comm_stage_bytes(p.hidden);
    pipe.stages = int(fit < kMaxCommStages ? fit : kMaxCommStages);
    pipe.base = reinterpret_cast<char*>(base);
    pipe.parity = 0;
    for (int s = 0; s < pipe.stages; ++s) cutlass::arch::ClusterTransactionBarrier::init(&pipe.full[s], 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// Thread 0: waits (bounded) for stage s's load to land. False after a timeout, which it reports.
__device__ inline bool wait_stage(const MegakernelLaunch& p, CommPipeline& pipe, int s, const core::Task& task) {
  const uint32_t parity = (pipe.parity >> s) & 1u;
  const uint64_t start = global_ns();
  while (!cutlass::arch::ClusterTransactionBarrier::try_wait(&pipe.full[s], parity)) {
    if (global_ns() - start > p.timeout_ns) {
      core::MegakernelStatus st;
      st.code = core::StatusCode::timeout;
      st.stage = task.kind;
      st.minibatch = core::minibatch_of_step(core::trim_to_rows(p.plan, p.offsets[p.local_experts]), task.step);
      st.row_tile = task.row_tile;
      report(p.control, st);
      return false;
    }
  }
  pipe.parity ^= 1u << s;
  return true;
}

// Thread 0: copies src[r] to dst[r] for every row with both ends, `bytes` each. Loads run up
// to `stages` rows ahead; a stage is reloaded once the store that read it has finished reading.
__device__ inline void bulk_copy_rows(const MegakernelLaunch& p, const core::Task& task, const int4* const* src,
                                      int4* const* dst, int rows, uint32_t bytes) {
  CommPipeline& pipe = comm_pipeline();
  const uint32_t stage_bytes = uint32_t(comm_stage_bytes(p.hidden));
  auto stage = [&](int s) { return pipe.base + size_t(s) * stage_bytes; };
  auto moves = [&](int r) { return src[r] != nullptr && dst[r] != nullptr; };
  int load_row = 0, loads = 0;
  auto load_next = [&] {
    while (load_row < rows && !moves(load_row)) ++load_row;
    if (load_row == rows) return;
    const int s = loads % pipe.stages;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&pipe.full[s], bytes);
    cute::SM90_BULK_COPY_G2S::copy(src[load_row], &pipe.full[s], stage(s), int32_t(bytes));
    ++load_row;
    ++loads;
  };
  for (int s = 0; s < pipe.stages; ++s) load_next();
  int store_row = 0;
  for (int n = 0;; ++n) {
    while (store_row < rows && !moves(store_row)) ++store_row;
    if (store_row == rows) break;
    const int s = n % pipe.stages;
    if (!wait_stage(p, pipe, s, task)) break;
    cute::SM90_BULK_COPY_S2G::copy(stage(s), dst[store_row], int32_t(bytes));
    cute::tma_store_arrive();
    ++store_row;
    if (n > 0) {
      cute::tma_store_wait<1>();  // store n - 1 has read its stage: reload it
      load_next();
    }
  }
  // Every copy complete (writes landed, reads done) before the CTA releases the task's counter.
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Warps other than 0: zeros into every row that has a destination but no source.
__device__ inline void zero_rows(const int4* const* src, int4* const* dst, int rows, int vectors) {
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
  for (int r = threadIdx.x / 32 - 1; r < rows; r += warps - 1) {
    if (src[r] || !dst[r]) continue;
    for (int v = lane; v < vectors; v += 32) dst[r][v] = make_int4(0, 0, 0, 0);
  }
}

struct RowEnds {
  const int4* from;
  int4* to;
};

// The row pointers of a routed row block (tile_m == kTileM rows), made once per task in shared
// memory: ends(ring row, global slot) gives {source row or null, destination row or null}; then
// thread 0 bulk-copies the rows with both ends while warps 1.. zero the rows with no source.
template <class Fn>
__device__ inline void copy_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan, const core::Task& task,
                                  Fn&& ends) {
  __shared__ const int4* src[kTileM];
  __shared__ int4* dst[kTileM];
  const int64_t first = core::task_first_row(plan, task);
  for (int64_t r = threadIdx.x; r < plan.tile_m; r += blockDim.x) {
    const int64_t row = first + r;
    const auto [from, to] = ends(core::ring_row(plan, row), p.slot_of_row[row]);
    src[r] = from;
    dst[r] = to;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bulk_copy_rows(p, task, src, dst, int(plan.tile_m), uint32_t(p.hidden * 2));
  } else if (threadIdx.x >= 32) {
    zero_rows(src, dst, int(plan.tile_m), int(p.hidden / 8));
  }
}

// Dispatch (pull): each row's token from its owner's symmetric x into the ring; zeros for padding.
__device__ inline void dispatch_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                      const core::Task& task) {
  const int64_t H = p.hidden, per_rank = p.tokens * p.top_k;
  copy_block(p, plan, task, [&](int64_t ring, int32_t slot) {
    const int4* from = nullptr;
    if (slot >= 0) {
      const int64_t source = slot / per_rank, token = (slot % per_rank) / p.top_k;
      from = reinterpret_cast<const int4*>(p.x_peers[source] + token * H);
    }
    return RowEnds{from, reinterpret_cast<int4*>(p.ring_x + ring * H)};
  });
  // The padding zeros (generic stores) are read next by TMA (async proxy) in the gate|up tiles.
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Combine (push): each routed row's output into its origin rank's combine slot token*k + j.
__device__ inline void combine_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                     const core::Task& task) {
  const int64_t H = p.hidden, per_rank = p.tokens * p.top_k;
  copy_block(p, plan, task, [&](int64_t ring, int32_t slot) {
    if (slot < 0) return RowEnds{nullptr, nullptr};
    int4* to = reinterpret_cast<int4*>(p.combine_peers[slot / per_rank] + (slot % per_rank) * H);
    return RowEnds{reinterpret_cast<const int4*>(p.ring_y + ring * H), to};
  });
}

__device__ inline void run_comm_task(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                     const core::Task& task) {
  if (task.kind == core::TaskKind::dispatch) {
    dispatch_block(p, plan, task);
  } else {
    combine_block(p, plan, task);
  }
}

}  // namespace moka::cuda::mk
