#include "core/megakernel_backward_plan.hpp"

#include "moka/error.hpp"

namespace moka::core {

MegakernelBackwardPlan build_backward_plan(const MegakernelConfig& config, const MegakernelBackwardDims& dims) {
  const auto& t = dims.tiling;
  require(t.tile_n >= 1 && t.pair_tile_n >= 1, ErrorCode::invalid_argument,
          "megakernel backward tiling: tile_n and pair_tile_n must be >= 1, got " + std::to_string(t.tile_n) + " and " +
              std::to_string(t.pair_tile_n));
  // The forward plan validates the shared knobs and sizes the schedule capacity and the ring.
  const MegakernelPlan f = build_megakernel_plan(config, dims.forward);
  const int64_t H = dims.forward.hidden, I = dims.forward.intermediate, Is = dims.forward.shared_intermediate;
  MegakernelBackwardPlan p;
  p.mode = dims.mode;
  p.tile_m = f.tile_m;
  p.tile_n = t.tile_n;
  p.pair_tile_n = t.pair_tile_n;
  p.minibatch_rows = f.minibatch_rows;
  p.macrobatch_rows = f.macrobatch_rows;
  p.capacity_rows = f.capacity_rows;
  p.ring_rows = f.ring_rows;
  p.max_steps = f.max_steps;
  p.max_macrobatches = ceil_div(p.capacity_rows, p.macrobatch_rows);
  p.row_tiles_per_minibatch = f.row_tiles_per_minibatch;
  p.minibatches_per_macrobatch = f.minibatches_per_macrobatch;
  p.hidden = H;
  p.intermediate = I;
  p.shared_intermediate = Is;
  p.tokens = dims.forward.tokens;
  p.gate_up_col_tiles = ceil_div(I, t.pair_tile_n);
  p.dgd_col_tiles = ceil_div(I, t.tile_n);
  p.dx_col_tiles = ceil_div(H, t.tile_n);
  p.wgrad_gate_up_tiles = ceil_div(I, p.tile_m) * ceil_div(H, t.pair_tile_n);
  p.wgrad_down_tiles = ceil_div(H, p.tile_m) * ceil_div(I, t.tile_n);
  if (Is > 0) {
    p.shared_row_tiles = ceil_div(p.tokens, p.tile_m);
    p.shared_gate_up_col_tiles = ceil_div(Is, t.pair_tile_n);
    p.shared_dgd_col_tiles = ceil_div(Is, t.tile_n);
    p.shared_wgrad_gate_up_tiles = ceil_div(Is, p.tile_m) * ceil_div(H, t.pair_tile_n);
    p.shared_wgrad_down_tiles = ceil_div(H, p.tile_m) * ceil_div(Is, t.tile_n);
  }
  return p;
}

SegmentTableStorage build_segment_table(const MegakernelBackwardPlan& p, const std::vector<int64_t>& expert_offset) {
  SegmentTableStorage table;
  table.segments.resize(max_segments(p));
  const auto experts = static_cast<int64_t>(expert_offset.size()) - 1;
  table.segments.resize(fill_weight_grad_segments(p, expert_offset.data(), experts, table.segments.data()));
  table.first_of_step.resize(p.num_steps + 1);
  fill_segment_steps(p, table.segments.data(), static_cast<int64_t>(table.segments.size()), table.first_of_step.data());
  return table;
}

namespace {

// The step whose compute tasks end the last reader of step q's ring slot: where the segment
// holding q's last row ends.
int64_t slot_readers_end(const MegakernelBackwardPlan& p, const SegmentTable& s, int64_t q) {
  const int64_t last_row = min_i64((q + 1) * p.minibatch_rows, p.total_rows) - 1;
  return step_of_tile(p, s.segments[segment_of_tile(p, s, last_row / p.tile_m)].last_tile);
}

}  // namespace

std::vector<BackwardTask> backward_plan_order(const MegakernelBackwardPlan& p, const SegmentTable& s) {
  std::vector<BackwardTask> order;
  int64_t compute = 0, comm = 0;
  for (; compute < shared_compute_task_count(p); ++compute) order.push_back(compute_task(p, s, compute));
  for (; comm < slot_steps(p) * p.row_tiles_per_minibatch; ++comm) order.push_back(comm_task(p, comm));
  for (int64_t step = 0; step < p.num_steps; ++step) {
    for (; compute < step_first_ticket(p, s, step + 1); ++compute) order.push_back(compute_task(p, s, compute));
    for (; comm < comm_task_count(p); ++comm) {
      const BackwardTask t = comm_task(p, comm);
      const int64_t q = t.kind == BackwardTaskKind::push ? t.step : predecessor_step(p, t.step);
      if (slot_readers_end(p, s, q) > step) break;
      order.push_back(t);
    }
  }
  return order;
}

int64_t carry_elements(const MegakernelBackwardPlan& p) { return 3 * p.intermediate * p.hidden; }

const char* to_string(BackwardTaskKind kind) {
  switch (kind) {
    case BackwardTaskKind::none: return "none";
    case BackwardTaskKind::shared_gate_up: return "shared_gate_up";
    case BackwardTaskKind::shared_dgd: return "shared_dgd";
    case BackwardTaskKind::shared_dx: return "shared_dx";
    case BackwardTaskKind::shared_wgrad: return "shared_wgrad";
    case BackwardTaskKind::pull: return "pull";
    case BackwardTaskKind::gate_up: return "gate_up";
    case BackwardTaskKind::dgd: return "dgd";
    case BackwardTaskKind::dx: return "dx";
    case BackwardTaskKind::push: return "push";
    case BackwardTaskKind::wgrad: return "wgrad";
  }
  return "?";
}

const char* to_string(BackwardCounterKind kind) {
  switch (kind) {
    case BackwardCounterKind::none: return "none";
    case BackwardCounterKind::rows_ready: return "rows_ready";
    case BackwardCounterKind::gate_up_ready: return "gate_up_ready";
    case BackwardCounterKind::dgu_ready: return "dgu_ready";
    case BackwardCounterKind::segment_ready: return "segment_ready";
    case BackwardCounterKind::dx_ready: return "dx_ready";
    case BackwardCounterKind::slot_free: return "slot_free";
    case BackwardCounterKind::shared_gate_up_ready: return "shared_gate_up_ready";
    case BackwardCounterKind::shared_dgu_ready: return "shared_dgu_ready";
    case BackwardCounterKind::shared_dgu_done: return "shared_dgu_done";
  }
  return "?";
}

const char* to_string(ContextMode mode) { return mode == ContextMode::resident ? "resident" : "replay"; }

std::string describe(const MegakernelBackwardPlan& p, const BackwardTask& t) {
  std::string s = to_string(t.kind);
  if (t.kind == BackwardTaskKind::wgrad)
    return s + " of segment " + std::to_string(t.segment) + ", tile " + std::to_string(t.col_tile);
  if (t.step < 0)
    return s + " of the shared expert, row tile " + std::to_string(t.row_tile) + ", column tile " +
           std::to_string(t.col_tile);
  return s + " of minibatch " + std::to_string(t.step) + " (macrobatch " +
         std::to_string(t.step / p.minibatches_per_macrobatch) + "), row tile " + std::to_string(t.row_tile) +
         ", column tile " + std::to_string(t.col_tile);
}

}  // namespace moka::core
