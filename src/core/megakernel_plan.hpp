// The plan the forward megakernel follows: its task space, the dependency counters between
// tasks, and the macrobatch ring buffer. Plain C++ shared by the CUDA kernel and the CPU
// emulation (src/cpu/megakernel_emulation.cpp), so both execute exactly the same schedule.
//
// Rows: the rank's expert-grouped receive buffer (core/schedule.hpp), `total_rows` rows, each
// expert padded to `tile_m`. It is cut into minibatches of `minibatch_rows` (the unit of
// compute/communication overlap) and macrobatches of `macrobatch_rows` (the ring buffer: every
// routed activation buffer holds one macrobatch; row r lives at ring row r % macrobatch_rows).
//
// Steps: minibatches in processing order. Macrobatches run last to first (so macrobatch 0's
// activations stay in the ring as the context backward reads), and inside each macrobatch the
// minibatches run last to first too. The first macrobatch processed (the highest) may be
// partial and then fills only the low ring slots; running every macrobatch backwards makes the
// next one start on the slots nobody used yet and reach the reused low slots last, so the step
// that reuses step s's slot is always s + minibatches_per_macrobatch. Slot-reusing dispatches
// therefore queue in step order right behind the prologue (the first minibatches_per_macrobatch
// steps): no compute step waits on a dispatch queued behind the dispatches of later steps.
// Every per-minibatch counter is indexed by step, so each counter is written by one minibatch
// only and rises monotonically to its target: no counter is ever reused.
//
// Tasks, in the one global topological order `plan_order` (see docs/MEGAKERNEL.md):
//   shared-expert gate|up tiles, shared-expert down tiles            (compute)
//   prologue: dispatch of every step that is the first to use its ring slot (comm)
//   for each step s: gate|up tiles(s), down tiles(s)                  (compute)
//                    combine blocks(s), dispatch blocks(successor(s)) (comm)
// where successor(s) is the next step to use s's ring slot. Compute CTAs take the compute
// subsequence through one global atomic ticket (`compute_task`), communication CTAs the comm
// subsequence through another (`comm_task`). Each task waits (acquire) on at most one counter
// (`task_wait`) and releases at most one (`task_release`).
//
// Progress, for any routing and any split with >= 1 comm and >= 1 compute CTA, all resident:
// every task a task waits for comes earlier in the global order, and a CTA holds one task at a
// time, taking tickets in order. Let X be the earliest task that never finishes: the tasks of
// its queue before X finish, so their CTAs come back and X's ticket is taken; everything X waits
// for is earlier, hence finishes, so X runs and finishes - a contradiction. In particular a comm
// CTA never waits for a task that cannot start (details in docs/MEGAKERNEL.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/hd.hpp"
#include "moka/config.hpp"
#include "moka/megakernel.hpp"

namespace moka::core {

// The knobs (moka/megakernel.hpp), shared with the kernel's plan.
using MegakernelConfig = moka::MegakernelConfig;

// Sizes of one rank's layer call that the plan depends on.
struct MegakernelDims {
  int world_size = 1;
  int64_t tokens = 0;  // T per rank
  int64_t top_k = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t shared_intermediate = 0;  // 0 = no shared expert
  int64_t num_local_experts = 0;
};

// POD: sized for the worst case on the host (build_megakernel_plan), trimmed on the device to
// the real row count (trim_to_rows) so the host never needs the counts.
struct MegakernelPlan {
  int64_t tile_m = 0, tile_n = 0, down_tile_n = 0, minibatch_rows = 0, macrobatch_rows = 0;
  int64_t band_row_tiles = 1;           // MegakernelConfig::band_row_tiles
  int64_t capacity_rows = 0;            // rows the schedule tables hold (padding included)
  int64_t ring_rows = 0;                // rows per ring buffer: macrobatch, or capacity in whole tiles if less
  int64_t row_tiles_per_minibatch = 0;  // also dispatch/combine blocks per minibatch
  int64_t minibatches_per_macrobatch = 0;
  int64_t gate_up_col_tiles = 0, down_col_tiles = 0;
  int64_t tokens = 0, shared_row_tiles = 0, shared_gate_up_col_tiles = 0;  // 0 tiles: no shared expert
  int64_t max_steps = 0;                                                   // minibatches of a full-capacity schedule
  // Run time.
  int64_t total_rows = 0, num_steps = 0, num_macrobatches = 0;
  int64_t first_macrobatch_steps = 0;  // minibatches of the last macrobatch, processed first
};

enum class TaskKind : int32_t { none, shared_gate_up, shared_down, dispatch, gate_up, down, combine };

// One unit of work. Routed tasks: `step` in processing order, `row_tile` inside the minibatch
// (an M tile, or a dispatch/combine row-block), `col_tile` an N tile. Shared-expert tasks:
// step -1, `row_tile` over the rank's own tokens.
struct Task {
  TaskKind kind = TaskKind::none;
  int64_t step = -1;
  int64_t row_tile = 0;
  int64_t col_tile = 0;
};

enum class CounterKind : int32_t {
  none,
  rows_ready,           // [step]: dispatch blocks landed in the ring
  hidden_ready,         // [step, row tile]: gate|up column tiles of that row tile done
  outputs_ready,        // [step]: down tiles done (y rows in the ring)
  outputs_sent,         // [step]: combine blocks pushed (ring rows free for reuse)
  shared_hidden_ready,  // [shared row tile]: shared gate|up column tiles done
};

// A counter and the value a waiting task needs (target) or a releasing task adds 1 to.
struct CounterRef {
  CounterKind kind = CounterKind::none;
  int64_t step = -1;
  int64_t tile = 0;
  int64_t target = 0;
};

// ---- Ring buffer and steps -------------------------------------------------------------------

MOKA_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MOKA_HD int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// The plan for a schedule of `total_rows` rows (callers first check fits_capacity).
MOKA_HD MegakernelPlan trim_to_rows(MegakernelPlan p, int64_t total_rows) {
  p.total_rows = total_rows;
  p.num_steps = ceil_div(total_rows, p.minibatch_rows);
  p.num_macrobatches = ceil_div(total_rows, p.macrobatch_rows);
  p.first_macrobatch_steps =
      p.num_macrobatches == 0 ? 0 : p.num_steps - (p.num_macrobatches - 1) * p.minibatches_per_macrobatch;
  return p;
}

MOKA_HD bool fits_capacity(const MegakernelPlan& p, int64_t total_rows) { return total_rows <= p.capacity_rows; }

// Index of the minibatch (in row order) that step `s` processes.
MOKA_HD int64_t minibatch_of_step(const MegakernelPlan& p, int64_t s) {
  const int64_t per_macro = p.minibatches_per_macrobatch;
  if (s < p.first_macrobatch_steps) return (p.num_macrobatches - 1) * per_macro + p.first_macrobatch_steps - 1 - s;
  const int64_t later = s - p.first_macrobatch_steps;
  const int64_t macrobatch = p.num_macrobatches - 2 - later / per_macro;
  return macrobatch * per_macro + per_macro - 1 - later % per_macro;
}

// Ring-slot reuse, the same for the forward plan and the backward plan (any Plan with
// minibatches_per_macrobatch and num_steps): step s uses slot s % minibatches_per_macrobatch.
// Ring slots in use: the steps of the prologue (in the forward, macrobatch 0's: processed last,
// its slots never reused).
template <class Plan>
MOKA_HD int64_t slot_steps(const Plan& p) {
  return min_i64(p.minibatches_per_macrobatch, p.num_steps);
}

// The next step that reuses step s's ring slot (the same minibatch, one macrobatch later in step
// order: in the forward, the previous macrobatch), or -1.
template <class Plan>
MOKA_HD int64_t successor_step(const Plan& p, int64_t s) {
  const int64_t next = s + p.minibatches_per_macrobatch;
  return next < p.num_steps ? next : -1;
}

// The step that used step s's ring slot before it, or -1 when s is the slot's first user.
template <class Plan>
MOKA_HD int64_t predecessor_step(const Plan& p, int64_t s) {
  return s >= p.minibatches_per_macrobatch ? s - p.minibatches_per_macrobatch : -1;
}

// First row (of the grouped buffer) a routed task touches; its tile_m rows are all real rows
// or padding when it is below total_rows, and all beyond the schedule otherwise.
MOKA_HD int64_t task_first_row(const MegakernelPlan& p, const Task& t) {
  return minibatch_of_step(p, t.step) * p.minibatch_rows + t.row_tile * p.tile_m;
}
MOKA_HD bool task_has_rows(const MegakernelPlan& p, const Task& t) { return task_first_row(p, t) < p.total_rows; }
MOKA_HD int64_t ring_row(const MegakernelPlan& p, int64_t row) { return row % p.macrobatch_rows; }

// ---- Counters --------------------------------------------------------------------------------

MOKA_HD int64_t counter_target(const MegakernelPlan& p, CounterKind kind) {
  switch (kind) {
    case CounterKind::rows_ready: return p.row_tiles_per_minibatch;
    case CounterKind::hidden_ready: return p.gate_up_col_tiles;
    case CounterKind::outputs_ready: return p.row_tiles_per_minibatch * p.down_col_tiles;
    case CounterKind::outputs_sent: return p.row_tiles_per_minibatch;
    case CounterKind::shared_hidden_ready: return p.shared_gate_up_col_tiles;
    case CounterKind::none: break;
  }
  return 0;
}

// Counters live in one zero-initialized array sized for the worst case.
MOKA_HD int64_t counter_count(const MegakernelPlan& p) {
  return p.max_steps * (4 + p.row_tiles_per_minibatch) + p.shared_row_tiles;
}

MOKA_HD int64_t counter_index(const MegakernelPlan& p, const CounterRef& c) {
  const int64_t steps = p.max_steps, hidden = p.max_steps * p.row_tiles_per_minibatch;
  switch (c.kind) {
    case CounterKind::rows_ready: return c.step;
    case CounterKind::hidden_ready: return steps + c.step * p.row_tiles_per_minibatch + c.tile;
    case CounterKind::outputs_ready: return steps + hidden + c.step;
    case CounterKind::outputs_sent: return 2 * steps + hidden + c.step;
    case CounterKind::shared_hidden_ready: return 3 * steps + hidden + c.tile;
    case CounterKind::none: break;
  }
  return -1;
}

MOKA_HD CounterRef counter_ref(const MegakernelPlan& p, CounterKind kind, int64_t step, int64_t tile) {
  return {kind, step, tile, counter_target(p, kind)};
}

// The counter a task must see at its target before it starts (acquire), or kind none.
MOKA_HD CounterRef task_wait(const MegakernelPlan& p, const Task& t) {
  switch (t.kind) {
    case TaskKind::shared_down: return counter_ref(p, CounterKind::shared_hidden_ready, -1, t.row_tile);
    case TaskKind::dispatch: {
      // Ring reuse: the rows being overwritten must have been sent by combine.
      const int64_t previous = predecessor_step(p, t.step);
      return previous < 0 ? CounterRef{} : counter_ref(p, CounterKind::outputs_sent, previous, 0);
    }
    case TaskKind::gate_up: return counter_ref(p, CounterKind::rows_ready, t.step, 0);
    case TaskKind::down: return counter_ref(p, CounterKind::hidden_ready, t.step, t.row_tile);
    case TaskKind::combine: return counter_ref(p, CounterKind::outputs_ready, t.step, 0);
    case TaskKind::shared_gate_up:
    case TaskKind::none: break;
  }
  return {};
}

// The counter a task adds 1 to (release) when done, or kind none. Tasks beyond the schedule's
// rows release too, so targets are the same for every minibatch.
MOKA_HD CounterRef task_release(const MegakernelPlan& p, const Task& t) {
  switch (t.kind) {
    case TaskKind::shared_gate_up: return counter_ref(p, CounterKind::shared_hidden_ready, -1, t.row_tile);
    case TaskKind::dispatch: return counter_ref(p, CounterKind::rows_ready, t.step, 0);
    case TaskKind::gate_up: return counter_ref(p, CounterKind::hidden_ready, t.step, t.row_tile);
    case TaskKind::down: return counter_ref(p, CounterKind::outputs_ready, t.step, 0);
    case TaskKind::combine: return counter_ref(p, CounterKind::outputs_sent, t.step, 0);
    case TaskKind::shared_down:  // read by the epilogue kernel, after the closing barrier
    case TaskKind::none: break;
  }
  return {};
}

// ---- Task decoders (ticket -> task) ----------------------------------------------------------

MOKA_HD int64_t shared_task_count(const MegakernelPlan& p) {
  return p.shared_row_tiles * (p.shared_gate_up_col_tiles + p.down_col_tiles);
}
MOKA_HD int64_t compute_tasks_per_step(const MegakernelPlan& p) {
  return p.row_tiles_per_minibatch * (p.gate_up_col_tiles + p.down_col_tiles);
}
MOKA_HD int64_t compute_task_count(const MegakernelPlan& p) {
  return shared_task_count(p) + p.num_steps * compute_tasks_per_step(p);
}

// Tile `i` of a rows x cols tile grid in band order: bands of `band` row tiles, and inside a
// band column by column (the last band may be shorter). band 1 is row-major order.
MOKA_HD Task banded_tile(TaskKind kind, int64_t step, int64_t i, int64_t rows, int64_t cols, int64_t band) {
  const int64_t first_row = i / (band * cols) * band;
  const int64_t height = rows - first_row < band ? rows - first_row : band;
  const int64_t j = i - first_row * cols;
  return {kind, step, first_row + j % height, j / height};
}

// Compute ticket -> task: shared gate|up, shared down, then per step its gate|up then down tiles,
// each GEMM's tiles in band order. Tickets past the end give TaskKind::none (the CTA exits).
MOKA_HD Task compute_task(const MegakernelPlan& p, int64_t ticket) {
  const int64_t band = p.band_row_tiles;
  const int64_t shared_gate_up = p.shared_row_tiles * p.shared_gate_up_col_tiles;
  if (ticket < shared_gate_up)
    return banded_tile(TaskKind::shared_gate_up, -1, ticket, p.shared_row_tiles, p.shared_gate_up_col_tiles, band);
  ticket -= shared_gate_up;
  const int64_t shared_down = p.shared_row_tiles * p.down_col_tiles;
  if (ticket < shared_down)
    return banded_tile(TaskKind::shared_down, -1, ticket, p.shared_row_tiles, p.down_col_tiles, band);
  ticket -= shared_down;
  const int64_t step = ticket / compute_tasks_per_step(p);
  if (step >= p.num_steps) return {};
  int64_t i = ticket % compute_tasks_per_step(p);
  const int64_t gate_up = p.row_tiles_per_minibatch * p.gate_up_col_tiles;
  if (i < gate_up) return banded_tile(TaskKind::gate_up, step, i, p.row_tiles_per_minibatch, p.gate_up_col_tiles, band);
  return banded_tile(TaskKind::down, step, i - gate_up, p.row_tiles_per_minibatch, p.down_col_tiles, band);
}

MOKA_HD int64_t comm_task_count(const MegakernelPlan& p) {
  // Every step is dispatched once and combined once.
  return 2 * p.num_steps * p.row_tiles_per_minibatch;
}

// Comm ticket -> task: the prologue dispatches (steps 0 .. slot_steps - 1), then per step its
// combine blocks followed by the dispatch blocks of the step that reuses its ring slot (the last
// slot_steps steps have none).
MOKA_HD Task comm_task(const MegakernelPlan& p, int64_t ticket) {
  const int64_t blocks = p.row_tiles_per_minibatch;
  const int64_t prologue = slot_steps(p) * blocks;
  if (ticket < prologue) return {TaskKind::dispatch, ticket / blocks, ticket % blocks, 0};
  ticket -= prologue;
  const int64_t reusing_steps = p.num_steps - slot_steps(p);
  if (ticket < reusing_steps * 2 * blocks) {
    const int64_t step = ticket / (2 * blocks), i = ticket % (2 * blocks);
    if (i < blocks) return {TaskKind::combine, step, i, 0};
    return {TaskKind::dispatch, successor_step(p, step), i - blocks, 0};
  }
  ticket -= reusing_steps * 2 * blocks;
  const int64_t step = reusing_steps + ticket / blocks;
  if (step >= p.num_steps) return {};
  return {TaskKind::combine, step, ticket % blocks, 0};
}

// ---- Errors the kernel reports through a status word (never a trap) ----------------------------

// invalid_expert and tokens_mismatch are input errors found on the device (the GPU layer's
// schedule kernels check every source rank's routing, so every rank reports the same error).
// peer_missing: the device barrier before the pulls timed out, so the peers' x may still be
// changing; the kernel then reads no peer memory.
// pipeline_timeout: a compute CTA's shared-memory pipeline (its mbarriers) stopped advancing,
// which only a TMA fault or a protocol error in the kernel causes.
enum class StatusCode : int32_t {
  ok,
  capacity_exceeded,
  timeout,
  invalid_expert,
  tokens_mismatch,
  peer_missing,
  pipeline_timeout
};

// The mbarrier wait of a compute CTA that timed out.
enum class PipelineWait : int32_t {
  none,
  operands_landed,  // consumers: a stage's TMA bytes
  stage_free,       // TMA producer: the consumers' release of a stage
  task_published,   // producer and consumers: the scheduler's next task
  task_finished,    // scheduler: a task-queue slot's readers
  box_written,      // store thread: the consumers' next output box in shared memory
  box_stored,       // consumers: the TMA store's read of an output buffer
};

// Written once (first failure wins) by the schedule kernel or a megakernel CTA; every wait polls
// `code` and gives up when it is set, so a failure ends the kernel instead of hanging it.
struct MegakernelStatus {
  StatusCode code = StatusCode::ok;
  TaskKind stage = TaskKind::none;  // timeout: the task that waited, on what, for which rows
  CounterKind counter = CounterKind::none;
  int64_t minibatch = -1;  // in row order (not the step, which depends on the rank's rows)
  int64_t row_tile = 0, target = 0, observed = 0;
  int64_t rows = 0, capacity = 0;  // capacity_exceeded: schedule rows needed and held
  // invalid_expert: the source rank, the entry [token, choice], the id and the expert count;
  // tokens_mismatch: the source rank and its token count, this rank's in `limit`;
  // peer_missing: the rank the barrier waited for in `source_rank`.
  int64_t source_rank = -1, token = 0, choice = 0, value = 0, limit = 0;
  PipelineWait pipeline_wait = PipelineWait::none;  // pipeline_timeout: which wait (stage, minibatch, row_tile: where)
};

// ---- Host only ---------------------------------------------------------------------------------

// Validates the config (Error invalid_argument naming the field) and sizes the worst case.
MegakernelPlan build_megakernel_plan(const MegakernelConfig& config, const MegakernelDims& dims);
void validate_megakernel_config(const MegakernelConfig& config);
// At least one compute CTA besides the communication CTAs.
void validate_megakernel_grid(const MegakernelConfig& config, int num_sms);

// Every task in the global topological order (comm and compute interleaved): the definition the
// decoders' subsequences follow. For tests and documentation; kernels use the decoders.
std::vector<Task> plan_order(const MegakernelPlan& p);

const char* to_string(TaskKind kind);
const char* to_string(CounterKind kind);
const char* to_string(PipelineWait wait);
std::string describe(const MegakernelPlan& p, const Task& t);

// Throws the moka::Error a failed status stands for (capacity_exceeded or timeout), naming the
// stage and the counter; callers report it collectively (validate_collectively adds the rank).
void throw_megakernel_status(const MegakernelStatus& status, const MegakernelConfig& config);

}  // namespace moka::core
