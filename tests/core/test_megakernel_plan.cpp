// The megakernel plan (src/core/megakernel_plan.hpp): the decoders follow the global order,
// every dependency points to an earlier task, counters reach exactly their targets, every row
// and tile is produced once, the counters order every pair of conflicting ring-buffer accesses,
// and any number of workers finishes the plan.
#include <gtest/gtest.h>

#include <map>
#include <queue>
#include <set>

#include "core/megakernel_plan.hpp"
#include "moka/error.hpp"

using namespace moka;
using namespace moka::core;

namespace {

struct PlanCase {
  int64_t tile_m, minibatch, macrobatch, total_rows;
  int64_t band_row_tiles = MegakernelConfig{}.band_row_tiles;
  friend std::ostream& operator<<(std::ostream& os, const PlanCase& c) {
    return os << "tile_m " << c.tile_m << ", minibatch " << c.minibatch << ", macrobatch " << c.macrobatch << ", rows "
              << c.total_rows << ", band " << c.band_row_tiles;
  }
};

// A plan sized so `total_rows` fits; shared expert over 5 tokens, I = 6, H = 8, tile_n = 4,
// down_tile_n = 3 (both GEMMs end in a partial column tile, with different tile counts).
MegakernelPlan make_plan(const PlanCase& c) {
  MegakernelConfig config;
  config.tile_rows = c.tile_m;
  config.tile_n = 4;
  config.down_tile_n = 3;
  config.band_row_tiles = c.band_row_tiles;
  config.minibatch_size = c.minibatch;
  config.macrobatch_size = c.macrobatch;
  config.capacity_multiplier = 1.0;
  const MegakernelDims dims{1, c.total_rows + 1, 1, 8, 6, 5, 1};
  const auto plan = build_megakernel_plan(config, dims);
  EXPECT_TRUE(fits_capacity(plan, c.total_rows));
  return trim_to_rows(plan, c.total_rows);
}

bool same(const Task& a, const Task& b) {
  return a.kind == b.kind && a.step == b.step && a.row_tile == b.row_tile && a.col_tile == b.col_tile;
}

bool is_comm(TaskKind k) { return k == TaskKind::dispatch || k == TaskKind::combine; }

// Every counter released, with the positions (in plan order) of its releasers.
std::map<int64_t, std::vector<size_t>> releasers(const MegakernelPlan& p, const std::vector<Task>& order) {
  std::map<int64_t, std::vector<size_t>> by_counter;
  for (size_t i = 0; i < order.size(); ++i) {
    const CounterRef r = task_release(p, order[i]);
    if (r.kind != CounterKind::none) by_counter[counter_index(p, r)].push_back(i);
  }
  return by_counter;
}

class MegakernelPlanInvariants : public ::testing::TestWithParam<PlanCase> {};

TEST_P(MegakernelPlanInvariants, DecodersFollowTheGlobalOrder) {
  const auto p = make_plan(GetParam());
  const auto order = plan_order(p);
  std::vector<Task> comm, compute;
  for (const auto& t : order) (is_comm(t.kind) ? comm : compute).push_back(t);
  ASSERT_EQ(static_cast<int64_t>(comm.size()), comm_task_count(p));
  ASSERT_EQ(static_cast<int64_t>(compute.size()), compute_task_count(p));
  for (size_t i = 0; i < comm.size(); ++i) EXPECT_TRUE(same(comm_task(p, i), comm[i])) << describe(p, comm[i]);
  for (size_t i = 0; i < compute.size(); ++i)
    EXPECT_TRUE(same(compute_task(p, i), compute[i])) << describe(p, compute[i]);
  EXPECT_EQ(comm_task(p, comm.size()).kind, TaskKind::none);
  EXPECT_EQ(compute_task(p, compute.size()).kind, TaskKind::none);
}

TEST_P(MegakernelPlanInvariants, DependenciesPointEarlierAndCountersReachTargets) {
  const auto p = make_plan(GetParam());
  const auto order = plan_order(p);
  const auto by_counter = releasers(p, order);
  std::set<int64_t> indices;
  for (size_t i = 0; i < order.size(); ++i) {
    const CounterRef r = task_release(p, order[i]);
    if (r.kind == CounterKind::none) continue;
    const int64_t index = counter_index(p, r);
    ASSERT_GE(index, 0);
    ASSERT_LT(index, counter_count(p));
    EXPECT_EQ(static_cast<int64_t>(by_counter.at(index).size()), r.target) << describe(p, order[i]);
    indices.insert(index);
  }
  for (size_t i = 0; i < order.size(); ++i) {
    const CounterRef w = task_wait(p, order[i]);
    if (w.kind == CounterKind::none) continue;
    const auto& who = by_counter.at(counter_index(p, w));
    EXPECT_EQ(static_cast<int64_t>(who.size()), w.target) << describe(p, order[i]);
    EXPECT_LT(who.back(), i) << describe(p, order[i]) << " waits for a later task";
  }
  // Distinct counters never share a slot: one slot per (kind, step, tile) released.
  std::set<std::tuple<int, int64_t, int64_t>> refs;
  for (const auto& t : order) {
    const CounterRef r = task_release(p, t);
    if (r.kind != CounterKind::none) refs.insert({static_cast<int>(r.kind), r.step, r.tile});
  }
  EXPECT_EQ(refs.size(), indices.size());
}

TEST_P(MegakernelPlanInvariants, EveryRowAndTileIsProducedOnce) {
  const auto p = make_plan(GetParam());
  std::map<std::tuple<TaskKind, int64_t, int64_t>, int> produced;  // (kind, first row, column tile)
  for (const auto& t : plan_order(p)) {
    if (t.step < 0) {
      ++produced[{t.kind, t.row_tile * p.tile_m, t.col_tile}];
    } else if (task_has_rows(p, t)) {
      ++produced[{t.kind, task_first_row(p, t), t.col_tile}];
    }
  }
  const std::map<TaskKind, int64_t> columns{{TaskKind::dispatch, 1},
                                            {TaskKind::combine, 1},
                                            {TaskKind::gate_up, p.gate_up_col_tiles},
                                            {TaskKind::down, p.down_col_tiles}};
  size_t expected = 0;
  for (const auto& [kind, cols] : columns) {
    for (int64_t row = 0; row < p.total_rows; row += p.tile_m)
      for (int64_t c = 0; c < cols; ++c) EXPECT_EQ((produced[{kind, row, c}]), 1) << to_string(kind) << " row " << row;
    expected += p.total_rows / p.tile_m * cols;
  }
  for (int64_t row = 0; row < p.tokens; row += p.tile_m) {
    for (int64_t c = 0; c < p.shared_gate_up_col_tiles; ++c)
      EXPECT_EQ((produced[{TaskKind::shared_gate_up, row, c}]), 1);
    for (int64_t c = 0; c < p.down_col_tiles; ++c) EXPECT_EQ((produced[{TaskKind::shared_down, row, c}]), 1);
  }
  expected += p.shared_row_tiles * (p.shared_gate_up_col_tiles + p.down_col_tiles);
  EXPECT_EQ(produced.size(), expected);
}

// Ring-buffer accesses of one task: (buffer, ring row, column tile or -1 for all, writes).
struct Access {
  char buffer;
  int64_t ring, col;
  bool write;
};

std::vector<Access> accesses(const MegakernelPlan& p, const Task& t) {
  if (t.step < 0) {  // shared expert: its hidden tile, per token row tile (not in the ring)
    const int64_t row = -1 - t.row_tile;
    if (t.kind == TaskKind::shared_gate_up) return {{'s', row, t.col_tile, true}};
    return {{'s', row, -1, false}};
  }
  if (!task_has_rows(p, t)) return {};
  const int64_t ring = ring_row(p, task_first_row(p, t));
  switch (t.kind) {
    case TaskKind::dispatch: return {{'x', ring, -1, true}};
    case TaskKind::gate_up: return {{'x', ring, -1, false}, {'h', ring, t.col_tile, true}};
    case TaskKind::down: return {{'h', ring, -1, false}, {'y', ring, t.col_tile, true}};
    case TaskKind::combine: return {{'y', ring, -1, false}};
    default: return {};
  }
}

bool conflict(const Access& a, const Access& b) {
  return a.buffer == b.buffer && a.ring == b.ring && (a.write || b.write) && (a.col < 0 || b.col < 0 || a.col == b.col);
}

// The counters alone (not the plan order) must order every pair of conflicting accesses:
// B waits on a counter released by A, transitively. That is race freedom for any timing.
TEST_P(MegakernelPlanInvariants, CountersOrderEveryConflictingRingAccess) {
  const auto p = make_plan(GetParam());
  const auto order = plan_order(p);
  const auto by_counter = releasers(p, order);
  const size_t n = order.size();
  std::vector<std::vector<bool>> after(n, std::vector<bool>(n, false));  // after[b][a]: a happens before b
  for (size_t b = 0; b < n; ++b) {
    const CounterRef w = task_wait(p, order[b]);
    if (w.kind == CounterKind::none) continue;
    for (size_t a : by_counter.at(counter_index(p, w))) {
      after[b][a] = true;
      for (size_t x = 0; x < n; ++x)
        if (after[a][x]) after[b][x] = true;
    }
  }
  for (size_t b = 0; b < n; ++b)
    for (size_t a = 0; a < b; ++a)
      for (const auto& x : accesses(p, order[a]))
        for (const auto& y : accesses(p, order[b]))
          if (conflict(x, y))
            EXPECT_TRUE(after[b][a]) << describe(p, order[b]) << " races with " << describe(p, order[a]);
}

TEST_P(MegakernelPlanInvariants, MacrobatchZeroStaysInTheRing) {
  const auto p = make_plan(GetParam());
  std::vector<int64_t> owner(p.ring_rows, -1);
  for (const auto& t : plan_order(p))
    if (t.kind == TaskKind::dispatch && task_has_rows(p, t)) {
      const int64_t first = task_first_row(p, t);
      for (int64_t r = first; r < first + p.tile_m; ++r) owner[ring_row(p, r)] = r;
    }
  for (int64_t r = 0; r < std::min(p.total_rows, p.ring_rows); ++r) EXPECT_EQ(owner[r], r);
  if (p.total_rows > 0) EXPECT_EQ(minibatch_of_step(p, p.num_steps - 1) / p.minibatches_per_macrobatch, 0);
}

// Workers that each hold one task and take the next ticket when done, run in an adversarial
// order (always the last worker that can proceed): the plan must finish for 1+1 workers and more.
TEST_P(MegakernelPlanInvariants, AnyWorkerCountsFinish) {
  const auto p = make_plan(GetParam());
  for (const auto [num_comm, num_compute] : {std::pair{1, 1}, {2, 1}, {1, 3}, {3, 2}}) {
    std::vector<int64_t> counters(counter_count(p), 0);
    int64_t comm_ticket = 0, compute_ticket = 0, done = 0;
    std::vector<std::pair<bool, Task>> workers;  // (comm?, held task)
    auto next = [&](bool comm) { return comm ? comm_task(p, comm_ticket++) : compute_task(p, compute_ticket++); };
    for (int i = 0; i < num_comm; ++i) workers.push_back({true, next(true)});
    for (int i = 0; i < num_compute; ++i) workers.push_back({false, next(false)});
    for (;;) {
      int ready = -1;
      bool busy = false;
      for (int i = 0; i < static_cast<int>(workers.size()); ++i) {
        const Task& t = workers[i].second;
        if (t.kind == TaskKind::none) continue;
        busy = true;
        const CounterRef w = task_wait(p, t);
        if (w.kind == CounterKind::none || counters[counter_index(p, w)] >= w.target) ready = i;
      }
      if (!busy) break;
      ASSERT_GE(ready, 0) << "deadlock with " << num_comm << " comm and " << num_compute << " compute workers";
      const CounterRef r = task_release(p, workers[ready].second);
      if (r.kind != CounterKind::none) ++counters[counter_index(p, r)];
      ++done;
      workers[ready].second = next(workers[ready].first);
    }
    EXPECT_EQ(done, comm_task_count(p) + compute_task_count(p));
  }
}

// A discrete-event run of the plan: `num_comm` and `num_compute` workers take tickets in order
// as they become free (as CTAs do), a task starts once its wait counter reached its target and
// takes cost(task) time units. Records, per task, its ticket (per role), when its worker took it
// and when it started and ended.
struct TaskRun {
  Task task;
  int64_t ticket = 0;
  double taken = 0, start = 0, end = 0;
};
struct PlanRun {
  std::vector<TaskRun> comm, compute;
  double span = 0;
};

template <class Cost>
PlanRun simulate(const MegakernelPlan& p, int num_comm, int num_compute, Cost&& cost) {
  PlanRun run;
  std::vector<int64_t> counters(counter_count(p), 0);
  std::map<int64_t, std::vector<TaskRun*>> blocked;  // counter index -> runs waiting on it
  using Event = std::pair<double, TaskRun*>;         // a task ends
  std::priority_queue<Event, std::vector<Event>, std::greater<>> ends;
  const int64_t comm_total = comm_task_count(p), compute_total = compute_task_count(p);
  run.comm.reserve(comm_total);
  run.compute.reserve(compute_total);
  auto start = [&](TaskRun* r, double now) {
    r->start = now;
    r->end = now + cost(r->task);
    ends.push({r->end, r});
  };
  auto take = [&](bool comm, double now) {
    std::vector<TaskRun>& runs = comm ? run.comm : run.compute;
    const int64_t ticket = static_cast<int64_t>(runs.size());
    if (ticket == (comm ? comm_total : compute_total)) return;
    runs.push_back({comm ? comm_task(p, ticket) : compute_task(p, ticket), ticket, now, 0, 0});
    TaskRun* r = &runs.back();
    const CounterRef w = task_wait(p, r->task);
    if (w.kind == CounterKind::none || counters[counter_index(p, w)] >= w.target) {
      start(r, now);
    } else {
      blocked[counter_index(p, w)].push_back(r);
    }
  };
  for (int i = 0; i < num_comm; ++i) take(true, 0);
  for (int i = 0; i < num_compute; ++i) take(false, 0);
  while (!ends.empty()) {
    const auto [now, done] = ends.top();
    ends.pop();
    run.span = now;
    const CounterRef r = task_release(p, done->task);
    if (r.kind != CounterKind::none) {
      const int64_t index = counter_index(p, r);
      if (++counters[index] == r.target) {
        for (TaskRun* waiting : blocked[index]) start(waiting, now);
        blocked.erase(index);
      }
    }
    take(is_comm(done->task.kind), now);
  }
  EXPECT_TRUE(blocked.empty()) << "tasks left waiting";
  EXPECT_EQ(static_cast<int64_t>(run.comm.size()), comm_total);
  EXPECT_EQ(static_cast<int64_t>(run.compute.size()), compute_total);
  return run;
}

// Dispatch slower than compute: the case where a queued dispatch decides when compute can go on.
double slow_comm_cost(const Task& t) {
  switch (t.kind) {
    case TaskKind::dispatch: return 5;
    case TaskKind::combine: return 3;
    default: return 1;
  }
}

// A compute task that waits for its step's rows must not find that step's dispatch queued
// behind dispatches of later steps: the communication CTAs would be pulling rows nobody needs
// yet while every compute CTA idles. With a partial first macrobatch, processing each
// macrobatch's minibatches first to last broke this (the slots the partial macrobatch used were
// dispatched again only after every fresh slot of the next macrobatch).
TEST_P(MegakernelPlanInvariants, NoComputeTaskWaitsOnADispatchQueuedBehindLaterSteps) {
  const auto p = make_plan(GetParam());
  const PlanRun run = simulate(p, 2, 3, slow_comm_cost);
  std::map<int64_t, int64_t> last_dispatch_ticket;  // step -> last dispatch ticket of that step
  for (const TaskRun& r : run.comm)
    if (r.task.kind == TaskKind::dispatch) last_dispatch_ticket[r.task.step] = r.ticket;
  std::set<int64_t> waiting_steps;  // steps with a gate|up task that waited for its rows
  for (const TaskRun& c : run.compute)
    if (c.task.kind == TaskKind::gate_up && c.start > c.taken) waiting_steps.insert(c.task.step);
  for (const int64_t step : waiting_steps)
    for (const TaskRun& d : run.comm)
      if (d.task.kind == TaskKind::dispatch && d.task.step > step && d.ticket < last_dispatch_ticket.at(step)) {
        ADD_FAILURE() << "step " << step << " (" << describe(p, {TaskKind::gate_up, step, 0, 0})
                      << ") waits on rows queued behind " << describe(p, d.task);
        break;
      }
}

// qwen3-30b-a3b at 16384 tokens per rank, EP=2 (the default config): 131072 routed rows plus
// padding, just over one macrobatch, with task costs in the proportions measured on the H200
// (gate|up tile 36 us, down tile 10 us, a 128-row dispatch or combine block ~33 us per CTA). The
// bounded ring must cost next to nothing against a ring that holds every row: before the order
// of each macrobatch was reversed, its tiny first macrobatch made the run 1.5x longer.
TEST(MegakernelPlan, BoundedRingCostsLittleOverAnUnboundedOneAtTheMacrobatchEdge) {
  MegakernelConfig config;  // minibatch 4096, macrobatch 131072, tiles 128
  const MegakernelDims dims{2, 16384, 8, 2048, 768, 0, 64};
  const int64_t rows = 16384 * 8 + 64 * 60;  // uniform routing: ~60 padding rows per expert
  auto span = [&](int64_t macrobatch) {
    config.macrobatch_size = macrobatch;
    const auto plan = trim_to_rows(build_megakernel_plan(config, dims), rows);
    EXPECT_TRUE(fits_capacity(plan, rows));
    return simulate(plan, 16, 116,
                    [](const Task& t) {
                      switch (t.kind) {
                        case TaskKind::gate_up: return 36.0;
                        case TaskKind::down: return 10.0;
                        default: return 33.0;
                      }
                    })
        .span;
  };
  const double bounded = span(131072), unbounded = span(262144);
  RecordProperty("bounded_over_unbounded", std::to_string(bounded / unbounded));
  EXPECT_LE(bounded, 1.05 * unbounded) << "bounded ring " << bounded << " us, unbounded " << unbounded << " us";
}

INSTANTIATE_TEST_SUITE_P(Shapes, MegakernelPlanInvariants,
                         ::testing::Values(PlanCase{2, 4, 16, 0},     // no routed rows
                                           PlanCase{2, 4, 16, 2},     // less than a minibatch
                                           PlanCase{2, 4, 16, 16},    // exactly one macrobatch
                                           PlanCase{2, 4, 16, 18},    // partial macrobatch of one partial minibatch
                                           PlanCase{2, 4, 16, 26},    // partial macrobatch of three minibatches
                                           PlanCase{2, 4, 16, 50},    // four macrobatches, the last partial
                                           PlanCase{2, 2, 2, 10},     // one minibatch per macrobatch: every step reuses
                                           PlanCase{3, 6, 12, 27},    // tile_m 3
                                           PlanCase{4, 4, 1024, 40},  // the ring holds everything
                                           PlanCase{1, 8, 16, 26, 1},  // row-major tiles
                                           PlanCase{1, 8, 16, 26, 3}   // bands of 3 row tiles, the last one of 2
                                           ));

TEST(MegakernelPlan, CapacityFollowsTheDesignFormula) {
  MegakernelConfig c;
  c.tile_rows = 4;
  c.minibatch_size = 4;
  c.macrobatch_size = 8;
  const int64_t T = 10, k = 2, local_experts = 3, padding = local_experts * (c.tile_rows - 1);
  auto capacity = [&](int world, double multiplier) {
    c.capacity_multiplier = multiplier;
    return build_megakernel_plan(c, {world, T, k, 8, 6, 0, local_experts}).capacity_rows;
  };
  EXPECT_EQ(capacity(4, 0.25), T * k * 2 + padding);  // max(2, ceil(1)) = 2
  EXPECT_EQ(capacity(4, 0.75), T * k * 3 + padding);  // ceil(3)
  EXPECT_EQ(capacity(4, 1.0), T * k * 4 + padding);   // every route of every rank
  EXPECT_EQ(capacity(1, 0.5), T * k * 1 + padding);   // capped at EP*T*k
  const auto p = build_megakernel_plan(c, {4, T, k, 8, 6, 0, local_experts});
  EXPECT_TRUE(fits_capacity(p, p.capacity_rows));
  EXPECT_FALSE(fits_capacity(p, p.capacity_rows + 1));
  EXPECT_LE(p.ring_rows, c.macrobatch_size);
}

void expect_invalid(const MegakernelConfig& c, const std::string& field) {
  try {
    validate_megakernel_config(c);
    ADD_FAILURE() << "accepted a bad " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

TEST(MegakernelPlan, ConfigValidationNamesTheField) {
  EXPECT_NO_THROW(validate_megakernel_config(MegakernelConfig{}));
  auto with = [](auto change) {
    MegakernelConfig c;
    change(c);
    return c;
  };
  expect_invalid(with([](auto& c) { c.num_comm_sms = 0; }), "num_comm_sms");
  expect_invalid(with([](auto& c) { c.tile_n = 0; }), "tile_n");
  expect_invalid(with([](auto& c) { c.down_tile_n = 0; }), "down_tile_n");
  expect_invalid(with([](auto& c) { c.band_row_tiles = 0; }), "band_row_tiles");
  expect_invalid(with([](auto& c) { c.minibatch_size = 4000; }), "minibatch_size");
  expect_invalid(with([](auto& c) { c.minibatch_size = 64; }), "minibatch_size");
  expect_invalid(with([](auto& c) { c.macrobatch_size = 4096 * 3 + 128; }), "macrobatch_size");
  expect_invalid(with([](auto& c) { c.macrobatch_size = 2048; }), "macrobatch_size");
  expect_invalid(with([](auto& c) { c.capacity_multiplier = 0; }), "capacity_multiplier");
  expect_invalid(with([](auto& c) { c.capacity_multiplier = 1.5; }), "capacity_multiplier");
  expect_invalid(with([](auto& c) { c.spin_timeout_seconds = 0; }), "spin_timeout_seconds");
  EXPECT_NO_THROW(validate_megakernel_grid(MegakernelConfig{}, 132));
  try {
    validate_megakernel_grid(MegakernelConfig{}, MegakernelConfig{}.num_comm_sms);
    ADD_FAILURE() << "no compute CTA left";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no compute CTA"), std::string::npos);
  }
}

// The GPU's device-side input errors become errors naming the rank whose input is bad.
TEST(MegakernelPlan, DeviceInputErrorsNameTheRankAndEntry) {
  auto message = [](const MegakernelStatus& s) -> std::string {
    try {
      throw_megakernel_status(s, MegakernelConfig{});
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return e.what();
    }
    ADD_FAILURE() << "no error";
    return "";
  };
  MegakernelStatus bad_id;
  bad_id.code = StatusCode::invalid_expert;
  bad_id.source_rank = 1;
  bad_id.token = 3;
  bad_id.choice = 1;
  bad_id.value = 99;
  bad_id.limit = 8;
  const std::string id_message = message(bad_id);
  EXPECT_NE(id_message.find("routing of rank 1: expert id 99 out of range [0, 8) at token 3, choice 1"),
            std::string::npos)
      << id_message;
  MegakernelStatus tokens;
  tokens.code = StatusCode::tokens_mismatch;
  tokens.source_rank = 2;
  tokens.value = 63;
  tokens.limit = 64;
  const std::string tokens_message = message(tokens);
  EXPECT_NE(tokens_message.find("rank 2 has 63 tokens, this rank 64"), std::string::npos) << tokens_message;
  EXPECT_NO_THROW(throw_megakernel_status(MegakernelStatus{}, MegakernelConfig{}));
}

// A compute CTA's stalled pipeline (an mbarrier wait past its bound) names the wait and the task.
TEST(MegakernelPlan, PipelineTimeoutNamesTheWaitAndTask) {
  MegakernelStatus s;
  s.code = StatusCode::pipeline_timeout;
  s.stage = TaskKind::down;
  s.pipeline_wait = PipelineWait::operands_landed;
  s.minibatch = 3;
  s.row_tile = 5;
  try {
    throw_megakernel_status(s, MegakernelConfig{});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    const std::string m = e.what();
    EXPECT_NE(m.find("wait operands_landed of stage down in minibatch 3 (macrobatch 0), row tile 5"), std::string::npos)
        << m;
  }
}

// Band order: bands of band_row_tiles row tiles, column by column inside a band, the last
// band shorter; every tile once.
TEST(MegakernelPlan, GemmTilesRunInBandsOfRowTilesColumnByColumn) {
  const int64_t rows = 5, cols = 3;
  std::vector<std::pair<int64_t, int64_t>> order;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const Task t = banded_tile(TaskKind::gate_up, 7, i, rows, cols, 2);
    EXPECT_EQ(t.kind, TaskKind::gate_up);
    EXPECT_EQ(t.step, 7);
    order.emplace_back(t.row_tile, t.col_tile);
  }
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 2},
                                                             {1, 2}, {2, 0}, {3, 0}, {2, 1}, {3, 1},
                                                             {2, 2}, {3, 2}, {4, 0}, {4, 1}, {4, 2}};
  EXPECT_EQ(order, expected);
  for (int64_t i = 0; i < rows * cols; ++i) {  // band 1: row-major
    const Task t = banded_tile(TaskKind::down, 0, i, rows, cols, 1);
    EXPECT_EQ(t.row_tile, i / cols);
    EXPECT_EQ(t.col_tile, i % cols);
  }
}

// Down tiles have their own width: the down and shared-down column tiles follow down_tile_n.
TEST(MegakernelPlan, DownTilesFollowDownTileN) {
  const auto p = make_plan({4, 8, 16, 16});
  EXPECT_EQ(p.gate_up_col_tiles, 2);  // I = 6 over 4
  EXPECT_EQ(p.down_col_tiles, 3);     // H = 8 over 3
  EXPECT_EQ(counter_target(p, CounterKind::outputs_ready), p.row_tiles_per_minibatch * 3);
}

// A barrier timeout before the pulls is a timeout naming the missing rank, and says that the
// kernel read no peer rows.
TEST(MegakernelPlan, BarrierTimeoutBeforeThePullsNamesTheMissingRank) {
  MegakernelStatus missing;
  missing.code = StatusCode::peer_missing;
  missing.source_rank = 3;
  try {
    throw_megakernel_status(missing, MegakernelConfig{});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_NE(std::string(e.what()).find("rank 3 did not arrive"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no peer rows were read"), std::string::npos) << e.what();
  }
}

}  // namespace
