#include "core/megakernel_plan.hpp"

#include <cmath>
#include <sstream>

#include "moka/error.hpp"

namespace moka::core {
namespace {

void require_config(bool ok, const std::string& message) {
  require(ok, ErrorCode::invalid_argument, "megakernel config: " + message);
}

// Routed rows the schedule tables hold: the design's T*k*max(2, ceil(EP*multiplier)), capped
// at EP*T*k (no rank can receive more), plus the worst-case padding of every local expert.
int64_t capacity_rows(const MegakernelConfig& c, const MegakernelDims& d) {
  const auto shares = static_cast<int64_t>(std::ceil(d.world_size * c.capacity_multiplier));
  const int64_t routed = d.tokens * d.top_k * min_i64(d.world_size, shares > 2 ? shares : 2);
  return routed + d.num_local_experts * (c.tile_rows - 1);
}

// Shortest form of a double ("0.25", not "0.250000").
std::string number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// "minibatch 3 (macrobatch 1)", or "shared expert" for minibatch -1.
std::string where(int64_t minibatch, int64_t minibatches_per_macrobatch) {
  if (minibatch < 0) return "shared expert";
  return "minibatch " + std::to_string(minibatch) + " (macrobatch " +
         std::to_string(minibatch / minibatches_per_macrobatch) + ")";
}

// A GEMM's tiles in the compute decoder's band order (dispatch and combine blocks: col_tiles 1).
void add_tiles(std::vector<Task>& order, TaskKind kind, int64_t step, int64_t row_tiles, int64_t col_tiles,
               int64_t band = 1) {
  for (int64_t i = 0; i < row_tiles * col_tiles; ++i)
    order.push_back(banded_tile(kind, step, i, row_tiles, col_tiles, band));
}

}  // namespace

void validate_megakernel_config(const MegakernelConfig& c) {
  require_config(c.num_comm_sms >= 1,
                 "num_comm_sms must be >= 1 (dispatch and combine need a CTA), got " + std::to_string(c.num_comm_sms));
  require_config(c.band_row_tiles >= 1, "band_row_tiles must be >= 1, got " + std::to_string(c.band_row_tiles));
  require_config(c.tile_rows >= 1 && c.tile_n >= 1 && c.down_tile_n >= 1,
                 "tile_rows, tile_n and down_tile_n must be >= 1, got " + std::to_string(c.tile_rows) + ", " +
                     std::to_string(c.tile_n) + " and " + std::to_string(c.down_tile_n));
  require_config(c.minibatch_size >= c.tile_rows && c.minibatch_size % c.tile_rows == 0,
                 "minibatch_size (" + std::to_string(c.minibatch_size) +
                     ") must be a positive multiple of tile_rows (" + std::to_string(c.tile_rows) + ")");
  require_config(c.macrobatch_size >= c.minibatch_size && c.macrobatch_size % c.minibatch_size == 0,
                 "macrobatch_size (" + std::to_string(c.macrobatch_size) +
                     ") must be a positive multiple of minibatch_size (" + std::to_string(c.minibatch_size) + ")");
  require_config(c.capacity_multiplier > 0 && c.capacity_multiplier <= 1,
                 "capacity_multiplier is the worst-case share of all routes landing on one rank and must be in "
                 "(0, 1], got " +
                     number(c.capacity_multiplier));
  require_config(c.spin_timeout_seconds > 0, "spin_timeout_seconds must be > 0, got " + number(c.spin_timeout_seconds));
}

void validate_megakernel_grid(const MegakernelConfig& c, int num_sms) {
  require_config(num_sms > c.num_comm_sms, "num_comm_sms (" + std::to_string(c.num_comm_sms) +
                                               ") leaves no compute CTA on " + std::to_string(num_sms) + " SMs");
}

MegakernelPlan build_megakernel_plan(const MegakernelConfig& c, const MegakernelDims& d) {
  validate_megakernel_config(c);
  MegakernelPlan p;
  p.tile_m = c.tile_rows;
  p.tile_n = c.tile_n;
  p.down_tile_n = c.down_tile_n;
  p.band_row_tiles = c.band_row_tiles;
  p.minibatch_rows = c.minibatch_size;
  p.macrobatch_rows = c.macrobatch_size;
  p.capacity_rows = capacity_rows(c, d);
  p.max_steps = ceil_div(p.capacity_rows, p.minibatch_rows);
  // A ring that holds every row needs only the rows a schedule can have (whole tiles: every task
  // past total_rows, which is a multiple of tile_m, is a no-op), not the last minibatch's tail.
  p.ring_rows = min_i64(p.macrobatch_rows, ceil_div(p.capacity_rows, p.tile_m) * p.tile_m);
  p.row_tiles_per_minibatch = c.minibatch_size / c.tile_rows;
  p.minibatches_per_macrobatch = c.macrobatch_size / c.minibatch_size;
  p.gate_up_col_tiles = ceil_div(d.intermediate, c.tile_n);
  p.down_col_tiles = ceil_div(d.hidden, c.down_tile_n);
  p.tokens = d.tokens;
  if (d.shared_intermediate > 0) {
    p.shared_row_tiles = ceil_div(d.tokens, c.tile_rows);
    p.shared_gate_up_col_tiles = ceil_div(d.shared_intermediate, c.tile_n);
  }
  return p;
}

std::vector<Task> plan_order(const MegakernelPlan& p) {
  std::vector<Task> order;
  const int64_t tiles = p.row_tiles_per_minibatch;
  const int64_t band = p.band_row_tiles;
  add_tiles(order, TaskKind::shared_gate_up, -1, p.shared_row_tiles, p.shared_gate_up_col_tiles, band);
  add_tiles(order, TaskKind::shared_down, -1, p.shared_row_tiles, p.down_col_tiles, band);
  for (int64_t s = 0; s < p.num_steps; ++s)
    if (predecessor_step(p, s) < 0) add_tiles(order, TaskKind::dispatch, s, tiles, 1);
  for (int64_t s = 0; s < p.num_steps; ++s) {
    add_tiles(order, TaskKind::gate_up, s, tiles, p.gate_up_col_tiles, band);
    add_tiles(order, TaskKind::down, s, tiles, p.down_col_tiles, band);
    add_tiles(order, TaskKind::combine, s, tiles, 1);
    const int64_t next = successor_step(p, s);
    if (next >= 0) add_tiles(order, TaskKind::dispatch, next, tiles, 1);
  }
  return order;
}

const char* to_string(TaskKind kind) {
  switch (kind) {
    case TaskKind::none: return "none";
    case TaskKind::shared_gate_up: return "shared_gate_up";
    case TaskKind::shared_down: return "shared_down";
    case TaskKind::dispatch: return "dispatch";
    case TaskKind::gate_up: return "gate_up";
    case TaskKind::down: return "down";
    case TaskKind::combine: return "combine";
  }
  return "?";
}

const char* to_string(CounterKind kind) {
  switch (kind) {
    case CounterKind::none: return "none";
    case CounterKind::rows_ready: return "rows_ready";
    case CounterKind::hidden_ready: return "hidden_ready";
    case CounterKind::outputs_ready: return "outputs_ready";
    case CounterKind::outputs_sent: return "outputs_sent";
    case CounterKind::shared_hidden_ready: return "shared_hidden_ready";
  }
  return "?";
}

const char* to_string(PipelineWait wait) {
  switch (wait) {
    case PipelineWait::none: return "none";
    case PipelineWait::operands_landed: return "operands_landed";
    case PipelineWait::stage_free: return "stage_free";
    case PipelineWait::task_published: return "task_published";
    case PipelineWait::task_finished: return "task_finished";
    case PipelineWait::box_written: return "box_written";
    case PipelineWait::box_stored: return "box_stored";
  }
  return "?";
}

std::string describe(const MegakernelPlan& p, const Task& t) {
  const int64_t minibatch = t.step < 0 ? -1 : minibatch_of_step(p, t.step);
  return std::string(to_string(t.kind)) + " of " + where(minibatch, p.minibatches_per_macrobatch) + ", row tile " +
         std::to_string(t.row_tile) + ", column tile " + std::to_string(t.col_tile);
}

void throw_megakernel_status(const MegakernelStatus& s, const MegakernelConfig& c) {
  const std::string who = "megakernel ";
  switch (s.code) {
    case StatusCode::ok: return;
    case StatusCode::capacity_exceeded:
      throw Error(ErrorCode::capacity_exceeded,
                  who + "receive schedule needs " + std::to_string(s.rows) + " rows but capacity is " +
                      std::to_string(s.capacity) + " (T*k*max(2, ceil(EP*capacity_multiplier)) + padding, " +
                      "capacity_multiplier " + number(c.capacity_multiplier) + "); raise capacity_multiplier");
    case StatusCode::timeout:
      throw Error(ErrorCode::timeout,
                  who + "stage " + to_string(s.stage) + " timed out after " + number(c.spin_timeout_seconds) +
                      " s in " + where(s.minibatch, c.macrobatch_size / c.minibatch_size) + ", row tile " +
                      std::to_string(s.row_tile) + ": waiting for " + to_string(s.counter) + " to reach " +
                      std::to_string(s.target) + ", saw " + std::to_string(s.observed));
    case StatusCode::pipeline_timeout:
      throw Error(ErrorCode::timeout,
                  who + "compute pipeline stalled: wait " + to_string(s.pipeline_wait) + " of stage " +
                      to_string(s.stage) + " in " + where(s.minibatch, c.macrobatch_size / c.minibatch_size) +
                      ", row tile " + std::to_string(s.row_tile) + " did not complete within " +
                      number(c.spin_timeout_seconds) + " s (a TMA fault or a kernel protocol error)");
    case StatusCode::invalid_expert:
      throw Error(ErrorCode::invalid_argument, who + "routing of rank " + std::to_string(s.source_rank) +
                                                   ": expert id " + std::to_string(s.value) + " out of range [0, " +
                                                   std::to_string(s.limit) + ") at token " + std::to_string(s.token) +
                                                   ", choice " + std::to_string(s.choice));
    case StatusCode::tokens_mismatch:
      throw Error(ErrorCode::invalid_argument, who + "token counts disagree across ranks: rank " +
                                                   std::to_string(s.source_rank) + " has " + std::to_string(s.value) +
                                                   " tokens, this rank " + std::to_string(s.limit) +
                                                   " (the megakernel needs the same count on every rank)");
    case StatusCode::peer_missing:
      throw Error(ErrorCode::timeout, who + "did not run: rank " + std::to_string(s.source_rank) +
                                          " did not arrive at the device "
                                          "barrier before the pulls within " +
                                          number(c.spin_timeout_seconds) + " s, so no peer rows were read");
  }
}

}  // namespace moka::core
