// The megakernel's communication role: dispatch pulls scheduled token rows from their owner's
// symmetric x over NVLink into the ring buffer (zero-filling padding rows); combine pushes
// expert output rows from the ring into the origin rank's combine buffer at slot token*k + j.
// One task is a block of tile_m rows, copied with 16-byte accesses, 16 in flight per lane.
#pragma once
#include <cstdint>

#include "core/megakernel_plan.hpp"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/tile_gemm.cuh"

namespace moka::cuda::mk {

// Each warp copies kRowsPerWarp rows at a time, kVectorsPerLane 16-byte vectors per lane of
// each, so every lane keeps 16 loads in flight (64 KiB per 256-thread CTA): the pulls are
// latency-bound (a ~1.3 us NVLink round trip), and one row of four vectors per lane moved only
// ~12 GB/s per CTA. Rows and vectors are walked by two loops, not one flat index: a division per
// 16-byte vector made the copy instruction-bound.
constexpr int kRowsPerWarp = 4;
constexpr int kVectorsPerLane = 4;

// Copies row r of a block from src[r] to dst[r] (src null: zeros; dst null: skipped), `vectors`
// int4 per row.
__device__ inline void copy_rows(const int4* const* src, int4* const* dst, int rows, int vectors) {
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
  for (int r0 = (threadIdx.x / 32) * kRowsPerWarp; r0 < rows; r0 += warps * kRowsPerWarp) {
    for (int v0 = lane; v0 < vectors; v0 += 32 * kVectorsPerLane) {
      int4 r[kRowsPerWarp][kVectorsPerLane];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int4* from = r0 + i < rows ? src[r0 + i] : nullptr;
#pragma unroll
        for (int u = 0; u < kVectorsPerLane; ++u) {
          const int v = v0 + 32 * u;
          r[i][u] = from && v < vectors ? from[v] : make_int4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        int4* to = r0 + i < rows ? dst[r0 + i] : nullptr;
#pragma unroll
        for (int u = 0; u < kVectorsPerLane; ++u) {
          const int v = v0 + 32 * u;
          if (to && v < vectors) to[v] = r[i][u];
        }
      }
    }
  }
}

struct RowEnds {
  const int4* from;
  int4* to;
};

// The row pointers of a routed row block (tile_m == kTileM rows), made once per task in shared
// memory. A communication CTA keeps them in the dynamic shared memory the compute role would use
// (static shared memory is reserved in every CTA, and the compute role needs all but a few bytes).
struct RowTable {
  const int4* src[kTileM];
  int4* dst[kTileM];
};

// ends(ring row, global slot) gives {source row or null, destination row or null}.
template <class Fn>
__device__ inline void copy_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan, const core::Task& task,
                                  RowTable& table, Fn&& ends) {
  auto& src = table.src;
  auto& dst = table.dst;
  const int64_t first = core::task_first_row(plan, task);
  for (int64_t r = threadIdx.x; r < plan.tile_m; r += blockDim.x) {
    const int64_t row = first + r;
    const auto [from, to] = ends(core::ring_row(plan, row), p.slot_of_row[row]);
    src[r] = from;
    dst[r] = to;
  }
  sync(kCtaGroup);
  copy_rows(src, dst, int(plan.tile_m), int(p.hidden / 8));
}

// Dispatch (pull): each row's token from its owner's symmetric x into the ring; zeros for padding.
__device__ inline void dispatch_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                      const core::Task& task, RowTable& table) {
  const int64_t H = p.hidden, per_rank = p.tokens * p.top_k;
  copy_block(p, plan, task, table, [&](int64_t ring, int32_t slot) {
    const int4* from = nullptr;
    if (slot >= 0) {
      const int64_t source = slot / per_rank, token = (slot % per_rank) / p.top_k;
      from = reinterpret_cast<const int4*>(p.x_peers[source] + token * H);
    }
    return RowEnds{from, reinterpret_cast<int4*>(p.ring_x + ring * H)};
  });
  // The ring rows are read next by TMA (async proxy) in the gate|up tiles.
  fence_proxy_async_global();
}

// Combine (push): each routed row's output into its origin rank's combine slot token*k + j
// (nothing where the down tiles stored it there: y_by_slot).
__device__ inline void combine_block(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                     const core::Task& task, RowTable& table) {
  if (p.y_by_slot) return;
  const int64_t H = p.hidden, per_rank = p.tokens * p.top_k;
  copy_block(p, plan, task, table, [&](int64_t ring, int32_t slot) {
    if (slot < 0) return RowEnds{nullptr, nullptr};
    int4* to = reinterpret_cast<int4*>(p.combine_peers[slot / per_rank] + (slot % per_rank) * H);
    return RowEnds{reinterpret_cast<const int4*>(p.ring_y + ring * H), to};
  });
}

__device__ inline void run_comm_task(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                     const core::Task& task, RowTable& table) {
  if (task.kind == core::TaskKind::dispatch) {
    dispatch_block(p, plan, task, table);
  } else {
    combine_block(p, plan, task, table);
  }
}

}  // namespace moka::cuda::mk
