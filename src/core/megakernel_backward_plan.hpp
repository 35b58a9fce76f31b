// The plan the backward megakernel follows: its tasks, the counters between them, the ring
// slots and the two ticket orders. Plain C++ shared by the CUDA kernel and the CPU
// emulation (src/cpu/megakernel_backward_emulation.cpp), so both execute the same schedule.
//
// Rows: the forward's expert-grouped receive buffer (core/schedule.hpp), each expert padded to
// `tile_m`, cut into minibatches (steps) and macrobatches (the ring: row r lives at ring row
// r % macrobatch_rows). Backward processes the steps in row order, so the rows of one expert
// are met in row order and a weight gradient that crosses a macrobatch boundary continues the
// same fp32 accumulation (see "segments"). The step that reuses step s's ring slot is
// s + minibatches_per_macrobatch.
//
// Tasks (docs/MEGAKERNEL.md, "Backward plan"):
//   comm    pull(s, block)     d_out rows and router weights (replay: x rows too) into the ring
//           push(s, block)     d_x rows to their origin slot token*k+j; d_topk_weights from the
//                              row's per-column-tile partials, summed in column order
//   compute shared_gate_up     replay only: g|u of the shared expert again, from the rank's x
//           shared_dgd         dH = d_out . W_down^T, h = act(g, u), (dg, du) = act'(g, u) dH
//           shared_dx          dx_shared = dg . W_gate + du . W_up (one accumulator, K = 2 Is)
//           shared_wgrad       dW_gate|up (two accumulators sharing x) or dW_down, K = T tokens
//           gate_up(s)         replay only: g|u of the routed rows again, from the pulled x
//           dgd(s)             as shared_dgd with dh = w * dH, and partials of d_w = <dH, h>
//           dx(s)              as shared_dx
//           wgrad(segment)     dW tiles of one expert over its rows in one macrobatch
// Compute order: the shared expert's tasks, then per step [gate_up], dgd, dx, then the weight
// gradients of every segment that ends in the step. Comm order (as the forward's): the first
// user of every ring slot is pulled in a prologue, then per step its push blocks followed by the
// pull of the step that reuses its slot.
//
// Segments: an expert's rows inside one macrobatch (whole row tiles, as experts are padded).
// Each segment's wgrad tasks wait for the dgd tiles of its rows and, when the expert started
// in the previous macrobatch, for the previous segment's wgrad tasks: those leave their fp32
// accumulators in a carry buffer (one per macrobatch boundary) that the next segment starts
// from, so dW is one pass over the expert's rows in row order whatever the macrobatch size.
// The segment table depends on the routing; the GPU builds it on the device next to the
// receive schedule (fill_weight_grad_segments), the host never needs it.
//
// Ring slot reuse: step s's slot is free once its push blocks and the wgrad tasks of every
// segment touching s are done (slot_free[s]); the pull of the reusing step waits for that. The
// segment holding s's last row may end in a later step of the macrobatch, so that pull can wait
// on a compute task placed after later pushes in the comm order: progress does not follow from
// one global order of both queues as in the forward but from the acyclicity of "waits on" plus
// "comes after in its queue": a topological order puts, after step s's compute tasks, the push
// and successor pull of every step whose last row's segment ends in s (docs/MEGAKERNEL.md has
// the argument; tests/core/test_megakernel_backward_plan.cpp checks it and runs the tickets).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/hd.hpp"
#include "core/megakernel_plan.hpp"

namespace moka::core {

// What backward reads of the forward: resident keeps routed x, g and u of every row (h is
// recomputed with the forward's own function, so the same bits); replay keeps nothing routed,
// pulls x again and recomputes g|u (more NVLink and FLOPs, far less memory).
enum class ContextMode : int32_t { resident, replay };

// Column tiles. Single-accumulator tiles (dgd over I, dx over H, dW_down over I) are tile_n
// wide: the forward's down tile. Two-accumulator tiles (g|u recompute over I, dW_gate|up over
// H) are pair_tile_n wide per matrix: the forward's gate|up tile.
struct BackwardTiling {
  int64_t tile_n = 128;
  int64_t pair_tile_n = 128;
};

// POD: sized for the worst case on the host (build_backward_plan), trimmed to the real row
// count on the device (backward_trim_to_rows).
struct MegakernelBackwardPlan {
  ContextMode mode = ContextMode::resident;
  int64_t tile_m = 0, tile_n = 0, pair_tile_n = 0, minibatch_rows = 0, macrobatch_rows = 0;
  int64_t capacity_rows = 0, ring_rows = 0, max_steps = 0, max_macrobatches = 0;
  int64_t row_tiles_per_minibatch = 0;  // also pull/push blocks per step
  int64_t minibatches_per_macrobatch = 0;
  int64_t hidden = 0, intermediate = 0, shared_intermediate = 0, tokens = 0;
  int64_t gate_up_col_tiles = 0, dgd_col_tiles = 0, dx_col_tiles = 0;
  int64_t wgrad_gate_up_tiles = 0, wgrad_down_tiles = 0;  // per segment
  int64_t shared_row_tiles = 0;                           // 0: no shared expert
  int64_t shared_gate_up_col_tiles = 0, shared_dgd_col_tiles = 0;
  int64_t shared_wgrad_gate_up_tiles = 0, shared_wgrad_down_tiles = 0;
  // Run time.
  int64_t total_rows = 0, num_steps = 0, num_macrobatches = 0;
};

// One expert's rows inside one macrobatch: row tiles [first_tile, last_tile] (global indices,
// row / tile_m). carry_in: the expert has rows in the previous macrobatch (start from its
// carry buffer); carry_out: it has rows in the next one (leave the accumulators there).
struct WeightGradSegment {
  int64_t expert = 0;
  int64_t first_tile = 0, last_tile = 0;
  bool carry_in = false, carry_out = false;
};

// The routing-dependent part of the plan: every segment in row order, and for each step the
// index of the first segment that ends in it or later (first_of_step[num_steps] = count).
struct SegmentTable {
  const WeightGradSegment* segments = nullptr;
  const int64_t* first_of_step = nullptr;
};

enum class BackwardTaskKind : int32_t {
  none,
  shared_gate_up,
  shared_dgd,
  shared_dx,
  shared_wgrad,
  pull,
  gate_up,
  dgd,
  dx,
  push,
  wgrad
};

// Routed tasks: `step` in processing order (= minibatch index), `row_tile` inside the step (or
// the pull/push block), `col_tile` a column tile. wgrad: `segment`, `step` where it ends,
// `col_tile` the tile (dW_gate|up tiles first, then dW_down). Shared tasks: step -1, `row_tile`
// over the rank's tokens (shared_wgrad: col_tile only).
struct BackwardTask {
  BackwardTaskKind kind = BackwardTaskKind::none;
  int64_t step = -1;
  int64_t row_tile = 0;
  int64_t col_tile = 0;
  int64_t segment = -1;
};

enum class BackwardCounterKind : int32_t {
  none,
  rows_ready,            // [step]: pull blocks landed
  gate_up_ready,         // [row tile]: replay g|u column tiles of that row tile done
  dgu_ready,             // [row tile]: dgd column tiles done (dg, du, h, d_w partials)
  segment_ready,         // [segment]: dgd tiles of its rows (+ the previous segment's wgrad)
  dx_ready,              // [step]: dx tiles done
  slot_free,             // [step]: pushes and the wgrad of segments touching it done
  shared_gate_up_ready,  // [shared row tile]
  shared_dgu_ready,      // [shared row tile]
  shared_dgu_done,       // [1]: every shared dgd tile (the shared wgrad's K spans all tokens)
};

// A counter (`at` indexes its kind's array) and the value a waiting task needs.
struct BackwardCounterRef {
  BackwardCounterKind kind = BackwardCounterKind::none;
  int64_t at = 0;
  int64_t target = 0;
};

// Counters a finished task adds 1 to: each range is one kind at indices [first, last].
struct BackwardCounterRange {
  BackwardCounterKind kind = BackwardCounterKind::none;
  int64_t first = 0, last = -1;
};
struct BackwardReleases {
  BackwardCounterRange range[2];
};

// ---- Steps, ring, segments -------------------------------------------------------------------

MOKA_HD MegakernelBackwardPlan backward_trim_to_rows(MegakernelBackwardPlan p, int64_t total_rows) {
  p.total_rows = total_rows;
  p.num_steps = ceil_div(total_rows, p.minibatch_rows);
  p.num_macrobatches = ceil_div(total_rows, p.macrobatch_rows);
  return p;
}

MOKA_HD bool fits_capacity(const MegakernelBackwardPlan& p, int64_t total_rows) {
  return total_rows <= p.capacity_rows;
}
MOKA_HD int64_t ring_row(const MegakernelBackwardPlan& p, int64_t row) { return row % p.macrobatch_rows; }
MOKA_HD int64_t step_of_tile(const MegakernelBackwardPlan& p, int64_t tile) { return tile / p.row_tiles_per_minibatch; }
MOKA_HD int64_t macrobatch_of_tile(const MegakernelBackwardPlan& p, int64_t tile) {
  return tile * p.tile_m / p.macrobatch_rows;
}
// First row of a routed task's tile (pull/push block, or the M tile of gate_up, dgd, dx).
MOKA_HD int64_t task_first_row(const MegakernelBackwardPlan& p, const BackwardTask& t) {
  return t.step * p.minibatch_rows + t.row_tile * p.tile_m;
}
MOKA_HD bool task_has_rows(const MegakernelBackwardPlan& p, const BackwardTask& t) {
  return task_first_row(p, t) < p.total_rows;
}
MOKA_HD int64_t wgrad_tiles(const MegakernelBackwardPlan& p) { return p.wgrad_gate_up_tiles + p.wgrad_down_tiles; }
MOKA_HD int64_t shared_wgrad_tiles(const MegakernelBackwardPlan& p) {
  return p.shared_wgrad_gate_up_tiles + p.shared_wgrad_down_tiles;
}
MOKA_HD int64_t segment_count(const MegakernelBackwardPlan& p, const SegmentTable& s) {
  return s.first_of_step[p.num_steps];
}
// Segments never exceed one per row tile (each row tile ends at most one).
MOKA_HD int64_t max_segments(const MegakernelBackwardPlan& p) { return p.max_steps * p.row_tiles_per_minibatch; }

// Cuts every expert's padded rows [expert_offset[e], expert_offset[e+1]) at the macrobatch
// boundaries; writes the segments in row order and returns their count (<= max_segments).
MOKA_HD int64_t fill_weight_grad_segments(const MegakernelBackwardPlan& p, const int64_t* expert_offset,
                                          int64_t num_experts, WeightGradSegment* out) {
  const int64_t tiles_per_macrobatch = p.macrobatch_rows / p.tile_m;
  int64_t n = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = expert_offset[e] / p.tile_m, end = expert_offset[e + 1] / p.tile_m;
    for (int64_t first = begin; first < end; ++n) {
      const int64_t last = min_i64(end, (first / tiles_per_macrobatch + 1) * tiles_per_macrobatch) - 1;
      out[n] = {e, first, last, first > begin, last < end - 1};
      first = last + 1;
    }
  }
  return n;
}

// first_of_step[s] for s in [0, num_steps]: segments ending before step s.
MOKA_HD void fill_segment_steps(const MegakernelBackwardPlan& p, const WeightGradSegment* segments, int64_t count,
                                int64_t* first_of_step) {
  int64_t n = 0;
  for (int64_t s = 0; s <= p.num_steps; ++s) {
    while (n < count && step_of_tile(p, segments[n].last_tile) < s) ++n;
    first_of_step[s] = n;
  }
}

// The segment holding global row tile `tile` (the first one ending at or after it).
MOKA_HD int64_t segment_of_tile(const MegakernelBackwardPlan& p, const SegmentTable& s, int64_t tile) {
  int64_t n = s.first_of_step[step_of_tile(p, tile)];
  while (s.segments[n].last_tile < tile) ++n;
  return n;
}

// Segments with rows in step s: those ending in it, and the one running on past its end.
MOKA_HD int64_t segments_touching_step(const MegakernelBackwardPlan& p, const SegmentTable& s, int64_t step) {
  const int64_t next = s.first_of_step[step + 1];
  const bool runs_on =
      next < segment_count(p, s) && s.segments[next].first_tile < (step + 1) * p.row_tiles_per_minibatch;
  return next - s.first_of_step[step] + (runs_on ? 1 : 0);
}

// ---- Counters --------------------------------------------------------------------------------

MOKA_HD int64_t counter_target(const MegakernelBackwardPlan& p, const SegmentTable& s, BackwardCounterKind kind,
                               int64_t at) {
  const int64_t blocks = p.row_tiles_per_minibatch;
  switch (kind) {
    case BackwardCounterKind::rows_ready: return blocks;
    case BackwardCounterKind::gate_up_ready: return p.gate_up_col_tiles;
    case BackwardCounterKind::dgu_ready: return p.dgd_col_tiles;
    case BackwardCounterKind::segment_ready: {
      const WeightGradSegment& g = s.segments[at];
      return (g.last_tile - g.first_tile + 1) * p.dgd_col_tiles + (g.carry_in ? wgrad_tiles(p) : 0);
    }
    case BackwardCounterKind::dx_ready: return blocks * p.dx_col_tiles;
    case BackwardCounterKind::slot_free: return blocks + wgrad_tiles(p) * segments_touching_step(p, s, at);
    case BackwardCounterKind::shared_gate_up_ready: return p.shared_gate_up_col_tiles;
    case BackwardCounterKind::shared_dgu_ready: return p.shared_dgd_col_tiles;
    case BackwardCounterKind::shared_dgu_done: return p.shared_row_tiles * p.shared_dgd_col_tiles;
    case BackwardCounterKind::none: break;
  }
  return 0;
}

// Counters live in one zero-initialized array sized for the worst case.
MOKA_HD int64_t counter_count(const MegakernelBackwardPlan& p) {
  return 3 * p.max_steps + 3 * max_segments(p) + 2 * p.shared_row_tiles + 1;
}

MOKA_HD int64_t counter_index(const MegakernelBackwardPlan& p, BackwardCounterKind kind, int64_t at) {
  const int64_t steps = p.max_steps, tiles = max_segments(p), shared = p.shared_row_tiles;
  switch (kind) {
    case BackwardCounterKind::rows_ready: return at;
    case BackwardCounterKind::gate_up_ready: return steps + at;
    case BackwardCounterKind::dgu_ready: return steps + tiles + at;
    case BackwardCounterKind::segment_ready: return steps + 2 * tiles + at;
    case BackwardCounterKind::dx_ready: return steps + 3 * tiles + at;
    case BackwardCounterKind::slot_free: return 2 * steps + 3 * tiles + at;
    case BackwardCounterKind::shared_gate_up_ready: return 3 * steps + 3 * tiles + at;
    case BackwardCounterKind::shared_dgu_ready: return 3 * steps + 3 * tiles + shared + at;
    case BackwardCounterKind::shared_dgu_done: return 3 * steps + 3 * tiles + 2 * shared;
    case BackwardCounterKind::none: break;
  }
  return -1;
}

MOKA_HD BackwardCounterRef wait_for(const MegakernelBackwardPlan& p, const SegmentTable& s, BackwardCounterKind kind,
                                    int64_t at) {
  return {kind, at, counter_target(p, s, kind, at)};
}

MOKA_HD int64_t global_tile(const MegakernelBackwardPlan& p, const BackwardTask& t) {
  return t.step * p.row_tiles_per_minibatch + t.row_tile;
}

// The counter a task must see at its target before it starts (acquire), or kind none.
MOKA_HD BackwardCounterRef task_wait(const MegakernelBackwardPlan& p, const SegmentTable& s, const BackwardTask& t) {
  using K = BackwardCounterKind;
  const bool replay = p.mode == ContextMode::replay;
  switch (t.kind) {
    case BackwardTaskKind::shared_dgd:
      return replay ? wait_for(p, s, K::shared_gate_up_ready, t.row_tile) : BackwardCounterRef{};
    case BackwardTaskKind::shared_dx: return wait_for(p, s, K::shared_dgu_ready, t.row_tile);
    case BackwardTaskKind::shared_wgrad: return wait_for(p, s, K::shared_dgu_done, 0);
    case BackwardTaskKind::pull: {
      // Ring reuse: the slot's previous step must be pushed and its weight gradients done.
      const int64_t previous = predecessor_step(p, t.step);
      return previous < 0 ? BackwardCounterRef{} : wait_for(p, s, K::slot_free, previous);
    }
    case BackwardTaskKind::gate_up: return wait_for(p, s, K::rows_ready, t.step);
    case BackwardTaskKind::dgd:
      return replay ? wait_for(p, s, K::gate_up_ready, global_tile(p, t)) : wait_for(p, s, K::rows_ready, t.step);
    case BackwardTaskKind::dx: return wait_for(p, s, K::dgu_ready, global_tile(p, t));
    case BackwardTaskKind::push: return wait_for(p, s, K::dx_ready, t.step);
    case BackwardTaskKind::wgrad: return wait_for(p, s, K::segment_ready, t.segment);
    case BackwardTaskKind::shared_gate_up:
    case BackwardTaskKind::none: break;
  }
  return {};
}

// The counters a task adds 1 to when done (release). Tasks beyond the schedule's rows release
// too, so targets stay the same for every step.
MOKA_HD BackwardReleases task_releases(const MegakernelBackwardPlan& p, const SegmentTable& s, const BackwardTask& t) {
  using K = BackwardCounterKind;
  auto one = [](K kind, int64_t at) { return BackwardCounterRange{kind, at, at}; };
  BackwardReleases r;
  switch (t.kind) {
    case BackwardTaskKind::shared_gate_up: r.range[0] = one(K::shared_gate_up_ready, t.row_tile); break;
    case BackwardTaskKind::shared_dgd:
      r.range[0] = one(K::shared_dgu_ready, t.row_tile);
      r.range[1] = one(K::shared_dgu_done, 0);
      break;
    case BackwardTaskKind::pull: r.range[0] = one(K::rows_ready, t.step); break;
    case BackwardTaskKind::gate_up: r.range[0] = one(K::gate_up_ready, global_tile(p, t)); break;
    case BackwardTaskKind::dgd:
      r.range[0] = one(K::dgu_ready, global_tile(p, t));
      if (task_has_rows(p, t)) r.range[1] = one(K::segment_ready, segment_of_tile(p, s, global_tile(p, t)));
      break;
    case BackwardTaskKind::dx: r.range[0] = one(K::dx_ready, t.step); break;
    case BackwardTaskKind::push: r.range[0] = one(K::slot_free, t.step); break;
    case BackwardTaskKind::wgrad: {
      const WeightGradSegment& g = s.segments[t.segment];
      r.range[0] = {K::slot_free, step_of_tile(p, g.first_tile), step_of_tile(p, g.last_tile)};
      if (g.carry_out) r.range[1] = one(K::segment_ready, t.segment + 1);
      break;
    }
    case BackwardTaskKind::shared_dx:     // read by the epilogue, after the closing barrier
    case BackwardTaskKind::shared_wgrad:  // final
    case BackwardTaskKind::none: break;
  }
  return r;
}

// ---- Task decoders (ticket -> task) ----------------------------------------------------------

MOKA_HD int64_t shared_compute_task_count(const MegakernelBackwardPlan& p) {
  const int64_t gate_up = p.mode == ContextMode::replay ? p.shared_gate_up_col_tiles : 0;
  const int64_t per_row_tile = gate_up + p.shared_dgd_col_tiles + p.dx_col_tiles;
  // The weight gradients run even over zero tokens (they write zeros).
  return p.shared_row_tiles * per_row_tile + shared_wgrad_tiles(p);
}
// Compute tasks of a step besides its weight gradients.
MOKA_HD int64_t row_tasks_per_step(const MegakernelBackwardPlan& p) {
  const int64_t gate_up = p.mode == ContextMode::replay ? p.gate_up_col_tiles : 0;
  return p.row_tiles_per_minibatch * (gate_up + p.dgd_col_tiles + p.dx_col_tiles);
}
MOKA_HD int64_t step_first_ticket(const MegakernelBackwardPlan& p, const SegmentTable& s, int64_t step) {
  return shared_compute_task_count(p) + step * row_tasks_per_step(p) + s.first_of_step[step] * wgrad_tiles(p);
}
MOKA_HD int64_t compute_task_count(const MegakernelBackwardPlan& p, const SegmentTable& s) {
  return step_first_ticket(p, s, p.num_steps);
}

// Row-tile-major tiles: ticket i of a block of `cols` column tiles per row tile.
MOKA_HD BackwardTask tile_task(BackwardTaskKind kind, int64_t step, int64_t i, int64_t cols) {
  return {kind, step, i / cols, i % cols, -1};
}

// Compute ticket -> task: the shared expert ([gate_up], dgd, dx, wgrad), then per step
// [gate_up], dgd, dx and the weight gradients of the segments ending in it. Past the end: none.
MOKA_HD BackwardTask compute_task(const MegakernelBackwardPlan& p, const SegmentTable& s, int64_t ticket) {
  using K = BackwardTaskKind;
  const bool replay = p.mode == ContextMode::replay;
  if (ticket < shared_compute_task_count(p)) {
    const int64_t gate_up = replay ? p.shared_row_tiles * p.shared_gate_up_col_tiles : 0;
    if (ticket < gate_up) return tile_task(K::shared_gate_up, -1, ticket, p.shared_gate_up_col_tiles);
    ticket -= gate_up;
    const int64_t dgd = p.shared_row_tiles * p.shared_dgd_col_tiles;
    if (ticket < dgd) return tile_task(K::shared_dgd, -1, ticket, p.shared_dgd_col_tiles);
    ticket -= dgd;
    const int64_t dx = p.shared_row_tiles * p.dx_col_tiles;
    if (ticket < dx) return tile_task(K::shared_dx, -1, ticket, p.dx_col_tiles);
    return {K::shared_wgrad, -1, 0, ticket - dx, -1};
  }
  if (ticket >= compute_task_count(p, s)) return {};
  int64_t lo = 0, hi = p.num_steps - 1;  // the last step starting at or before the ticket
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (step_first_ticket(p, s, mid) <= ticket) lo = mid;
    else hi = mid - 1;
  }
  const int64_t step = lo, rows = p.row_tiles_per_minibatch;
  int64_t i = ticket - step_first_ticket(p, s, step);
  const int64_t gate_up = replay ? rows * p.gate_up_col_tiles : 0;
  if (i < gate_up) return tile_task(K::gate_up, step, i, p.gate_up_col_tiles);
  i -= gate_up;
  if (i < rows * p.dgd_col_tiles) return tile_task(K::dgd, step, i, p.dgd_col_tiles);
  i -= rows * p.dgd_col_tiles;
  if (i < rows * p.dx_col_tiles) return tile_task(K::dx, step, i, p.dx_col_tiles);
  i -= rows * p.dx_col_tiles;
  return {K::wgrad, step, 0, i % wgrad_tiles(p), s.first_of_step[step] + i / wgrad_tiles(p)};
}

MOKA_HD int64_t comm_task_count(const MegakernelBackwardPlan& p) { return 2 * p.num_steps * p.row_tiles_per_minibatch; }

// Comm ticket -> task: the prologue pulls (the first user of each slot), then per step its push
// blocks followed by the pull blocks of the step reusing its slot.
MOKA_HD BackwardTask comm_task(const MegakernelBackwardPlan& p, int64_t ticket) {
  using K = BackwardTaskKind;
  const int64_t blocks = p.row_tiles_per_minibatch;
  const int64_t prologue = slot_steps(p) * blocks;
  if (ticket < prologue) return {K::pull, ticket / blocks, ticket % blocks, 0, -1};
  ticket -= prologue;
  const int64_t reusing_steps = p.num_steps - slot_steps(p);
  if (ticket < reusing_steps * 2 * blocks) {
    const int64_t step = ticket / (2 * blocks), i = ticket % (2 * blocks);
    if (i < blocks) return {K::push, step, i, 0, -1};
    return {K::pull, successor_step(p, step), i - blocks, 0, -1};
  }
  ticket -= reusing_steps * 2 * blocks;
  const int64_t step = reusing_steps + ticket / blocks;
  if (step >= p.num_steps) return {};
  return {K::push, step, ticket % blocks, 0, -1};
}

MOKA_HD bool is_comm(BackwardTaskKind kind) { return kind == BackwardTaskKind::pull || kind == BackwardTaskKind::push; }

// ---- Host only ---------------------------------------------------------------------------------

struct MegakernelBackwardDims {
  MegakernelDims forward;  // the layer call's sizes (world size, T, k, H, I, Is, local experts)
  ContextMode mode = ContextMode::resident;
  BackwardTiling tiling;
};

// Validates the config and tiling (Error invalid_argument naming the field) and sizes the worst
// case; `config` gives tile_rows, the backward's minibatch and macrobatch (its ring) and the
// capacity, as for the forward.
MegakernelBackwardPlan build_backward_plan(const MegakernelConfig& config, const MegakernelBackwardDims& dims);

// The segment table of a trimmed plan, owned (the host's copy of what the GPU fills in place).
struct SegmentTableStorage {
  std::vector<WeightGradSegment> segments;
  std::vector<int64_t> first_of_step;
  SegmentTable view() const { return {segments.data(), first_of_step.data()}; }
};
SegmentTableStorage build_segment_table(const MegakernelBackwardPlan& p, const std::vector<int64_t>& expert_offset);

// Both queues merged into one topological order of "waits on" and "comes after in its queue":
// the shared tasks and prologue pulls, then per step s its compute tasks followed by the push and
// successor pull of every step whose last row's segment ends in s. For tests and documentation
// (the progress argument); kernels use the decoders.
std::vector<BackwardTask> backward_plan_order(const MegakernelBackwardPlan& p, const SegmentTable& s);

// fp32 elements of one macrobatch boundary's carry buffer: one expert's dW_gate, dW_up and
// dW_down accumulators; the kernel needs (max_macrobatches - 1) of them.
int64_t carry_elements(const MegakernelBackwardPlan& p);

const char* to_string(BackwardTaskKind kind);
const char* to_string(BackwardCounterKind kind);
const char* to_string(ContextMode mode);
std::string describe(const MegakernelBackwardPlan& p, const BackwardTask& t);

}  // namespace moka::core
