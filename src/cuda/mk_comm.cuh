// The megakernel's communication role: dispatch pulls scheduled token rows from their owner's
// symmetric x over NVLink into the ring buffer (zero-filling padding rows); combine pushes
// expert output rows from the ring into the origin rank's combine buffer at slot token*k + j.
// One task is a block of tile_m rows; each warp copies whole rows with 16-byte accesses.
#pragma once
#include <cstdint>

#include "core/megakernel_plan.hpp"
#include "cuda/megakernel_launch.hpp"

namespace moka::cuda::mk {

constexpr int kUnroll = 4;  // 16-byte loads in flight per lane before the stores

// Copies `vectors` int4 from src to dst (src null: zeros) with one warp.
__device__ inline void copy_row(const int4* __restrict__ src, int4* __restrict__ dst, int64_t vectors) {
  const int lane = threadIdx.x & 31;
  if (!src) {
    for (int64_t v = lane; v < vectors; v += 32) dst[v] = make_int4(0, 0, 0, 0);
    return;
  }
  int64_t v = lane;
  for (; v + 32 * (kUnroll - 1) < vectors; v += 32 * kUnroll) {
    int4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = src[v + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[v + 32 * u] = r[u];
  }
  for (; v < vectors; v += 32) dst[v] = src[v];
}

// fn(grouped row, ring row, global slot) for each row of a routed row block, one warp per row.
template <class Fn>
__device__ inline void for_block_rows(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                      const core::Task& task, Fn&& fn) {
  const int64_t first = core::task_first_row(plan, task);
  for (int64_t r = threadIdx.x / 32; r < plan.tile_m; r += blockDim.x / 32) {
    const int64_t row = first + r;
    fn(row, core::ring_row(plan, row), p.slot_of_row[row]);
  }
}

__device__ inline void dispatch_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                      const core::Task& task) {
  const int64_t H = p.hidden, per_rank = p.tokens * p.top_k;
  for_block_rows(p, plan, task, [&](int64_t, int64_t ring, int32_t slot) {
    const int4* src = nullptr;
    if (slot >= 0) {
      const int64_t source = slot / per_rank, token = (slot % per_rank) / p.top_k;
      src = reinterpret_cast<const int4*>(p.x_peers[source] + token * H);
    }
    copy_row(src, reinterpret_cast<int4*>(p.ring_x + ring * H), H / 8);
  });
  // The ring rows are read next by TMA (async proxy) in the gate|up tiles.
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ inline void combine_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                     const core::Task& task) {
  const int64_t H = p.hidden, per_rank = p.tokens * p.top_k;
  for_block_rows(p, plan, task, [&](int64_t, int64_t ring, int32_t slot) {
    if (slot < 0) return;
    const int64_t source = slot / per_rank;
    bf16* dst = p.combine_peers[source] + (slot % per_rank) * H;
    copy_row(reinterpret_cast<const int4*>(p.ring_y + ring * H), reinterpret_cast<int4*>(dst), H / 8);
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
