// The megakernel's compute role: shared-expert and routed expert tiles on the GEMM core
// (mk_tile_gemm.cuh). A gate|up tile computes 128 rows x 128 hidden columns of both gate and
// up (two accumulators sharing the A tile) and applies SwiGLU in its epilogue, writing gate, up
// and hidden (the saved context of backward); a down tile computes 128 x 128 of y.
// Numerics match the CUDA layer's (its gate GEMM's SwiGLU epilogue, swiglu_epilogue.cuh, and its
// unfused path alike): gate and up are rounded to bf16 before the activation, which is
// evaluated in fp32 (core/activation.hpp, the CPU reference's function).
#pragma once
#include <cuda_bf16.h>

#include "core/activation.hpp"
#include "core/megakernel_plan.hpp"
#include "cuda/megakernel/megakernel_launch.hpp"
#include "cuda/megakernel/mk_tile_gemm.cuh"

namespace moka::cuda::mk {

// Descriptors of every operand the compute tiles read (kernel parameters, __grid_constant__).
struct Operands {
  Operand x_local, ring_x, ring_hidden, shared_hidden;  // activations: [rows, K]
  Operand w_gate, w_up, w_down, ws_gate, ws_up, ws_down;  // weights: [E or 1, N, K]
};

// Where a tile's outputs go: rows [row0, row0 + valid_rows) and columns [col0, col0 + 128) of
// row-major buffers `width` columns wide (columns past it are the last tile's overhang).
struct TileOut {
  int64_t row0, valid_rows, col0, width;
};

__device__ inline void store_pair(bf16* base, const TileOut& o, int r, int c, float v0, float v1) {
  if (r >= o.valid_rows || o.col0 + c >= o.width) return;
  *reinterpret_cast<__nv_bfloat162*>(base + (o.row0 + r) * o.width + o.col0 + c) = __floats2bfloat162_rn(v0, v1);
}

__device__ inline void store_tile(const Accumulator& acc, bf16* out, const TileOut& o) {
  for_each_pair(acc, [&](int r, int c, int i) { store_pair(out, o, r, c, acc(i), acc(i + 1)); });
  fence_generic_to_async();
}

__device__ inline float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ inline void store_swiglu_tile(const Accumulator& gate, const Accumulator& up, bf16* g_out, bf16* u_out,
                                         bf16* h_out, const TileOut& o, ActParams act) {
  for_each_pair(gate, [&](int r, int c, int i) {
    const float g0 = round_bf16(gate(i)), g1 = round_bf16(gate(i + 1));
    const float u0 = round_bf16(up(i)), u1 = round_bf16(up(i + 1));
    store_pair(g_out, o, r, c, g0, g1);
    store_pair(u_out, o, r, c, u0, u1);
    store_pair(h_out, o, r, c, core::swiglu_forward<float>(g0, u0, act.clamped, act.limit),
               core::swiglu_forward<float>(g1, u1, act.clamped, act.limit));
  });
  fence_generic_to_async();
}

// Local expert whose padded segment holds grouped row `row` (tiles never span two experts).
__device__ inline int expert_of_row(const int32_t* offsets, int64_t experts, int64_t row) {
  int lo = 0, hi = int(experts) - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct ComputeState {
  TileSmem& smem;
  uint32_t kblocks_done = 0;
  Accumulator acc0, acc1;
};

__device__ inline void gate_up_tile(ComputeState& st, const TileCoord& a, const Operand& wg, const Operand& wu,
                                    int col_tile, int batch, bf16* g, bf16* u, bf16* h, const TileOut& o,
                                    ActParams act) {
  const TileCoord b0{&wg, col_tile, batch}, b1{&wu, col_tile, batch};
  mma_tile(st.smem, st.kblocks_done, a, b0, &b1, st.acc0, st.acc1);
  store_swiglu_tile(st.acc0, st.acc1, g, u, h, o, act);
}

__device__ inline void down_tile(ComputeState& st, const TileCoord& a, const Operand& w, int col_tile, int batch,
                                 bf16* y, const TileOut& o) {
  const TileCoord b{&w, col_tile, batch};
  mma_tile(st.smem, st.kblocks_done, a, b, nullptr, st.acc0, st.acc1);
  store_tile(st.acc0, y, o);
}

__device__ inline void run_compute_task(ComputeState& st, const MegakernelLaunch& p, const Operands& ops,
                                        const core::MegakernelPlan& plan, const core::Task& t) {
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, tm = plan.tile_m, tn = plan.tile_n;
  const int col = int(t.col_tile);
  switch (t.kind) {
    case core::TaskKind::shared_gate_up: {
      const TileOut o{t.row_tile * tm, p.tokens - t.row_tile * tm, col * tn, Is};
      gate_up_tile(st, {&ops.x_local, int(t.row_tile), 0}, ops.ws_gate, ops.ws_up, col, 0, p.shared_gate,
                   p.shared_up, p.shared_hidden, o, p.act);
      return;
    }
    case core::TaskKind::shared_down: {
      const TileOut o{t.row_tile * tm, p.tokens - t.row_tile * tm, col * tn, H};
      down_tile(st, {&ops.shared_hidden, int(t.row_tile), 0}, ops.ws_down, col, 0, p.shared_out, o);
      return;
    }
    case core::TaskKind::gate_up:
    case core::TaskKind::down: {
      const int64_t first = core::task_first_row(plan, t), ring = core::ring_row(plan, first);
      const int expert = expert_of_row(p.offsets, p.local_experts, first);
      if (t.kind == core::TaskKind::gate_up) {
        const TileOut o{ring, tm, col * tn, I};
        gate_up_tile(st, {&ops.ring_x, int(ring / tm), 0}, ops.w_gate, ops.w_up, col, expert, p.ring_gate,
                     p.ring_up, p.ring_hidden, o, p.act);
      } else {
        const TileOut o{ring, tm, col * tn, H};
        down_tile(st, {&ops.ring_hidden, int(ring / tm), 0}, ops.w_down, col, expert, p.ring_y, o);
      }
      return;
    }
    default: return;
  }
}

}  // namespace moka::cuda::mk
