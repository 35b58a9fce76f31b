// The megakernel's communication role: dispatch pulls scheduled token rows from their owner's
// symmetric x over NVLink into the ring buffer (zero-filling padding rows); combine pushes
// expert output rows from the ring into the origin rank's combine buffer at slot token*k + j.
// One task is a block of tile_m rows, copied with 16-byte accesses as one flat index space.
#pragma once
#include <cstdint>

#include "core/megakernel_plan.hpp"
#include "cuda/megakernel_launch.hpp"
#include "cuda/mk_tile_gemm.cuh"

namespace moka::cuda::mk {

// 16-byte vectors each thread keeps in flight: the pulls are latency-bound (a ~1.3 us NVLink
// round trip), so a CTA needs kUnroll * 16 B * blockDim bytes outstanding (64 KiB here) to move
// more than ~12 GB/s, which is all four vectors per lane of one row at a time gave.
constexpr int kUnroll = 16;

// Copies row r of a block from src[r] to dst[r] (src null: zeros; dst null: skipped), `vectors`
// int4 per row, the whole block as one flat index space so every thread has kUnroll vectors of
// possibly different rows in flight.
__device__ inline void copy_rows(const int4* const* src, int4* const* dst, int rows, int64_t vectors) {
  const int64_t total = int64_t(rows) * vectors;
  for (int64_t base = threadIdx.x; base < total; base += int64_t(blockDim.x) * kUnroll) {
    int4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i >= total) break;
      const int4* from = src[i / vectors];
      r[u] = from ? from[i % vectors] : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i >= total) break;
      int4* to = dst[i / vectors];
      if (to) to[i % vectors] = r[u];
    }
  }
}

struct RowEnds {
  const int4* from;
  int4* to;
};

// The row pointers of a routed row block (tile_m == kTileM rows), made once per task in shared
// memory: ends(ring row, global slot) gives {source row or null, destination row or null}.
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
  copy_rows(src, dst, int(plan.tile_m), p.hidden / 8);
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
  // The ring rows are read next by TMA (async proxy) in the gate|up tiles.
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
