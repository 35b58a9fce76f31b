// The backward megakernel plan (src/core/megakernel_backward_plan.hpp) and its progress proof:
// counters reach exactly their targets, every task and output tile exists once, segments cut
// every expert at the macrobatch boundaries, "waits on" plus "comes after in its queue" has no
// cycle (so no split of comm/compute CTAs can deadlock), the counters alone order every pair of
// conflicting ring-slot and carry-buffer accesses, and discrete-event runs with random task
// costs, CTA counts and routings finish with every task run once and no overlapping conflict.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <queue>
#include <random>
#include <set>

#include "core/megakernel_backward_plan.hpp"
#include "moka/error.hpp"

using namespace moka;
using namespace moka::core;

namespace {

struct BackwardCase {
  int64_t tile_m, minibatch, macrobatch;
  std::vector<int64_t> expert_rows;  // real rows per local expert
  ContextMode mode;
  bool shared;
  friend std::ostream& operator<<(std::ostream& os, const BackwardCase& c) {
    os << "tile_m " << c.tile_m << ", minibatch " << c.minibatch << ", macrobatch " << c.macrobatch << ", rows [";
    for (int64_t r : c.expert_rows) os << r << " ";
    return os << "], " << to_string(c.mode) << (c.shared ? ", shared" : "");
  }
};

// A trimmed plan with its segment table; H 8, I 6, Is 5, tile_n 4, pair_tile_n 3.
struct PlanWithTable {
  MegakernelBackwardPlan plan;
  SegmentTableStorage table;
  SegmentTable segments() const { return table.view(); }
};

PlanWithTable make_plan(const BackwardCase& c) {
  MegakernelConfig config;
  config.tile_rows = c.tile_m;
  config.minibatch_size = c.minibatch;
  config.macrobatch_size = c.macrobatch;
  config.capacity_multiplier = 1.0;
  std::vector<int64_t> offset{0};
  for (int64_t rows : c.expert_rows) offset.push_back(offset.back() + (rows + c.tile_m - 1) / c.tile_m * c.tile_m);
  const auto experts = static_cast<int64_t>(c.expert_rows.size());
  const MegakernelDims forward{1, offset.back() + 1, 1, 8, 6, c.shared ? 5 : 0, experts};
  auto worst = build_backward_plan(config, {forward, c.mode, {4, 3}});
  EXPECT_TRUE(fits_capacity(worst, offset.back()));
  PlanWithTable out;
  out.plan = backward_trim_to_rows(worst, offset.back());
  out.table = build_segment_table(out.plan, offset);
  return out;
}

bool same(const BackwardTask& a, const BackwardTask& b) {
  return a.kind == b.kind && a.step == b.step && a.row_tile == b.row_tile && a.col_tile == b.col_tile &&
         a.segment == b.segment;
}

// Every task: the comm queue, then the compute queue, in ticket order.
struct Queues {
  std::vector<BackwardTask> comm, compute;
  std::vector<BackwardTask> all() const {
    auto v = comm;
    v.insert(v.end(), compute.begin(), compute.end());
    return v;
  }
};

Queues queues(const PlanWithTable& pt) {
  Queues q;
  for (int64_t i = 0; i < comm_task_count(pt.plan); ++i) q.comm.push_back(comm_task(pt.plan, i));
  for (int64_t i = 0; i < compute_task_count(pt.plan, pt.segments()); ++i)
    q.compute.push_back(compute_task(pt.plan, pt.segments(), i));
  return q;
}

template <class Fn>
void for_each_release(const PlanWithTable& pt, const BackwardTask& t, Fn&& fn) {
  for (const auto& range : task_releases(pt.plan, pt.segments(), t).range)
    for (int64_t at = range.first; at <= range.last && range.kind != BackwardCounterKind::none; ++at)
      fn(range.kind, at);
}

// Counter index -> the tasks (indices into `tasks`) that release it.
std::map<int64_t, std::vector<size_t>> releasers(const PlanWithTable& pt, const std::vector<BackwardTask>& tasks) {
  std::map<int64_t, std::vector<size_t>> by_counter;
  for (size_t i = 0; i < tasks.size(); ++i)
    for_each_release(pt, tasks[i], [&](BackwardCounterKind kind, int64_t at) {
      by_counter[counter_index(pt.plan, kind, at)].push_back(i);
    });
  return by_counter;
}

class BackwardPlanInvariants : public ::testing::TestWithParam<BackwardCase> {};

TEST_P(BackwardPlanInvariants, DecodersEndAndCountersReachExactlyTheirTargets) {
  const auto pt = make_plan(GetParam());
  const auto& p = pt.plan;
  EXPECT_EQ(comm_task(p, comm_task_count(p)).kind, BackwardTaskKind::none);
  EXPECT_EQ(compute_task(p, pt.segments(), compute_task_count(p, pt.segments())).kind, BackwardTaskKind::none);
  const auto tasks = queues(pt).all();
  const auto by_counter = releasers(pt, tasks);
  std::set<std::pair<int, int64_t>> refs;
  for (const auto& t : tasks)
    for_each_release(pt, t, [&](BackwardCounterKind kind, int64_t at) {
      const int64_t index = counter_index(p, kind, at);
      ASSERT_GE(index, 0);
      ASSERT_LT(index, counter_count(p));
      EXPECT_EQ(static_cast<int64_t>(by_counter.at(index).size()), counter_target(p, pt.segments(), kind, at))
          << to_string(kind) << " " << at << ", released by " << describe(p, t);
      refs.insert({static_cast<int>(kind), at});
    });
  EXPECT_EQ(refs.size(), by_counter.size()) << "two counters share a slot";
  for (const auto& t : tasks) {
    const auto w = task_wait(p, pt.segments(), t);
    if (w.kind == BackwardCounterKind::none) continue;
    const auto it = by_counter.find(counter_index(p, w.kind, w.at));
    const int64_t released = it == by_counter.end() ? 0 : static_cast<int64_t>(it->second.size());
    EXPECT_EQ(released, w.target) << describe(p, t) << " waits on " << to_string(w.kind) << " " << w.at;
  }
}

TEST_P(BackwardPlanInvariants, EveryTileAndSegmentTileRunsOnce) {
  const auto c = GetParam();
  const auto pt = make_plan(c);
  const auto& p = pt.plan;
  std::map<std::tuple<BackwardTaskKind, int64_t, int64_t>, int> produced;  // (kind, first row or segment, column)
  for (const auto& t : queues(pt).all()) {
    if (t.kind == BackwardTaskKind::wgrad) {
      ++produced[{t.kind, t.segment, t.col_tile}];
    } else if (t.step < 0) {
      ++produced[{t.kind, t.row_tile, t.col_tile}];
    } else if (task_has_rows(p, t)) {
      ++produced[{t.kind, task_first_row(p, t), t.col_tile}];
    }
  }
  const bool replay = c.mode == ContextMode::replay;
  std::map<BackwardTaskKind, int64_t> routed{{BackwardTaskKind::pull, 1},
                                             {BackwardTaskKind::push, 1},
                                             {BackwardTaskKind::dgd, p.dgd_col_tiles},
                                             {BackwardTaskKind::dx, p.dx_col_tiles}};
  if (replay) routed[BackwardTaskKind::gate_up] = p.gate_up_col_tiles;
  size_t expected = 0;
  for (const auto& [kind, cols] : routed) {
    for (int64_t row = 0; row < p.total_rows; row += p.tile_m)
      for (int64_t col = 0; col < cols; ++col)
        EXPECT_EQ((produced[{kind, row, col}]), 1) << to_string(kind) << " row " << row;
    expected += p.total_rows / p.tile_m * cols;
  }
  const auto& segments = pt.table.segments;
  for (size_t s = 0; s < segments.size(); ++s)
    for (int64_t tile = 0; tile < wgrad_tiles(p); ++tile)
      EXPECT_EQ((produced[{BackwardTaskKind::wgrad, static_cast<int64_t>(s), tile}]), 1);
  expected += segments.size() * wgrad_tiles(p);
  if (c.shared) {
    std::map<BackwardTaskKind, int64_t> shared{{BackwardTaskKind::shared_dgd, p.shared_dgd_col_tiles},
                                               {BackwardTaskKind::shared_dx, p.dx_col_tiles}};
    if (replay) shared[BackwardTaskKind::shared_gate_up] = p.shared_gate_up_col_tiles;
    for (const auto& [kind, cols] : shared)
      for (int64_t r = 0; r < p.shared_row_tiles; ++r)
        for (int64_t col = 0; col < cols; ++col) EXPECT_EQ((produced[{kind, r, col}]), 1) << to_string(kind);
    for (const auto& [kind, cols] : shared) expected += p.shared_row_tiles * cols;
    for (int64_t tile = 0; tile < shared_wgrad_tiles(p); ++tile)
      EXPECT_EQ((produced[{BackwardTaskKind::shared_wgrad, 0, tile}]), 1);
    expected += shared_wgrad_tiles(p);
  }
  EXPECT_EQ(produced.size(), expected);
}

// Segments tile every expert's rows, in row order, never crossing a macrobatch boundary, with
// carries exactly where an expert continues in the next macrobatch.
TEST_P(BackwardPlanInvariants, SegmentsCutExpertsAtMacrobatchBoundaries) {
  const auto c = GetParam();
  const auto pt = make_plan(c);
  const auto& p = pt.plan;
  const auto& segments = pt.table.segments;
  int64_t tile = 0;
  size_t n = 0;
  for (size_t e = 0; e < c.expert_rows.size(); ++e) {
    const int64_t end = tile + (c.expert_rows[e] + c.tile_m - 1) / c.tile_m;
    for (int64_t first = tile; first < end; ++n) {
      ASSERT_LT(n, segments.size());
      const auto& s = segments[n];
      EXPECT_EQ(s.expert, static_cast<int64_t>(e));
      EXPECT_EQ(s.first_tile, first);
      EXPECT_EQ(macrobatch_of_tile(p, s.first_tile), macrobatch_of_tile(p, s.last_tile));
      EXPECT_EQ(s.carry_in, first > tile);
      EXPECT_EQ(s.carry_out, s.last_tile < end - 1);
      if (s.carry_out) EXPECT_EQ(macrobatch_of_tile(p, s.last_tile + 1), macrobatch_of_tile(p, s.last_tile) + 1);
      EXPECT_EQ(segment_of_tile(p, pt.segments(), first), static_cast<int64_t>(n));
      first = s.last_tile + 1;
    }
    tile = end;
  }
  EXPECT_EQ(n, segments.size());
  for (int64_t s = 0; s < p.num_steps; ++s)
    for (int64_t i = pt.table.first_of_step[s]; i < pt.table.first_of_step[s + 1]; ++i)
      EXPECT_EQ(step_of_tile(p, segments[i].last_tile), s);
}

// A task is held by a CTA from the moment it took the ticket; it can start once what it waits
// for is done. With "after the previous ticket of its queue" and "after every releaser of its
// counter" as edges, no cycle means: the earliest (in a topological order) task that never
// finishes would have its previous ticket finished (so a CTA takes it) and its inputs done - a
// contradiction, for any number >= 1 of comm and of compute CTAs and any timing.
TEST_P(BackwardPlanInvariants, WaitsAndQueueOrderHaveNoCycle) {
  const auto pt = make_plan(GetParam());
  const auto q = queues(pt);
  const auto tasks = q.all();
  const auto by_counter = releasers(pt, tasks);
  const size_t n = tasks.size(), comm = q.comm.size();
  std::vector<std::vector<size_t>> next(n);
  std::vector<int> incoming(n, 0);
  auto edge = [&](size_t from, size_t to) {
    next[from].push_back(to);
    ++incoming[to];
  };
  for (size_t i = 1; i < n; ++i)
    if (i != comm) edge(i - 1, i);
  for (size_t i = 0; i < n; ++i) {
    const auto w = task_wait(pt.plan, pt.segments(), tasks[i]);
    if (w.kind == BackwardCounterKind::none) continue;
    for (size_t a : by_counter.at(counter_index(pt.plan, w.kind, w.at))) edge(a, i);
  }
  std::vector<size_t> ready;
  for (size_t i = 0; i < n; ++i)
    if (incoming[i] == 0) ready.push_back(i);
  size_t visited = 0;
  while (!ready.empty()) {
    const size_t i = ready.back();
    ready.pop_back();
    ++visited;
    for (size_t j : next[i])
      if (--incoming[j] == 0) ready.push_back(j);
  }
  if (visited != n) {
    for (size_t i = 0; i < n; ++i)
      if (incoming[i] > 0) {
        ADD_FAILURE() << "on a cycle or behind one: " << describe(pt.plan, tasks[i]);
        break;
      }
  }
}

// The documented topological order: it holds every task once, each queue in ticket order, and
// every task after the previous ticket of its queue and after every releaser of its counter.
TEST_P(BackwardPlanInvariants, DocumentedOrderIsTopological) {
  const auto pt = make_plan(GetParam());
  const auto q = queues(pt);
  const auto order = backward_plan_order(pt.plan, pt.segments());
  ASSERT_EQ(order.size(), q.comm.size() + q.compute.size());
  std::vector<BackwardTask> comm, compute;
  for (const auto& t : order) (is_comm(t.kind) ? comm : compute).push_back(t);
  ASSERT_EQ(comm.size(), q.comm.size());
  for (size_t i = 0; i < comm.size(); ++i) ASSERT_TRUE(same(comm[i], q.comm[i])) << describe(pt.plan, comm[i]);
  for (size_t i = 0; i < compute.size(); ++i)
    ASSERT_TRUE(same(compute[i], q.compute[i])) << describe(pt.plan, compute[i]);
  const auto by_counter = releasers(pt, order);
  for (size_t i = 0; i < order.size(); ++i) {
    const auto w = task_wait(pt.plan, pt.segments(), order[i]);
    if (w.kind != BackwardCounterKind::none)
      EXPECT_LT(by_counter.at(counter_index(pt.plan, w.kind, w.at)).back(), i) << describe(pt.plan, order[i]);
  }
}

// Accesses of one task to the ring or the carry buffers: (buffer, row tile of the ring or
// carry boundary, column or -1 for all, writes).
struct Access {
  char buffer;
  int64_t slot, col;
  bool write;
};

std::vector<Access> accesses(const PlanWithTable& pt, const BackwardTask& t) {
  const auto& p = pt.plan;
  auto ring_tile = [&](int64_t global_tile) { return ring_row(p, global_tile * p.tile_m) / p.tile_m; };
  if (t.kind == BackwardTaskKind::wgrad) {
    const auto& s = pt.table.segments[t.segment];
    std::vector<Access> a;
    for (int64_t tile = s.first_tile; tile <= s.last_tile; ++tile) {
      a.push_back({'d', ring_tile(tile), -1, false});  // d_out, w (replay: x)
      a.push_back({'h', ring_tile(tile), -1, false});  // dg, du, h
    }
    if (s.carry_in) a.push_back({'c', macrobatch_of_tile(p, s.first_tile) - 1, t.col_tile, false});
    if (s.carry_out) a.push_back({'c', macrobatch_of_tile(p, s.last_tile), t.col_tile, true});
    return a;
  }
  if (t.step < 0 || !task_has_rows(p, t)) return {};  // the shared expert owns its buffers
  const int64_t slot = ring_tile(global_tile(p, t));
  switch (t.kind) {
    case BackwardTaskKind::pull: return {{'d', slot, -1, true}};
    case BackwardTaskKind::gate_up: return {{'d', slot, -1, false}, {'g', slot, t.col_tile, true}};
    case BackwardTaskKind::dgd: return {{'d', slot, -1, false}, {'g', slot, -1, false}, {'h', slot, t.col_tile, true}};
    case BackwardTaskKind::dx: return {{'h', slot, -1, false}, {'x', slot, t.col_tile, true}};
    case BackwardTaskKind::push: return {{'x', slot, -1, false}, {'h', slot, -1, false}, {'d', slot, -1, false}};
    default: return {};
  }
}

bool conflict(const Access& a, const Access& b) {
  return a.buffer == b.buffer && a.slot == b.slot && (a.write || b.write) && (a.col < 0 || b.col < 0 || a.col == b.col);
}

// Conflicting (task, task) pairs.
std::vector<std::pair<size_t, size_t>> conflicting_pairs(const PlanWithTable& pt,
                                                         const std::vector<BackwardTask>& tasks) {
  std::map<std::pair<char, int64_t>, std::vector<std::pair<size_t, Access>>> by_slot;
  for (size_t i = 0; i < tasks.size(); ++i)
    for (const auto& a : accesses(pt, tasks[i])) by_slot[{a.buffer, a.slot}].push_back({i, a});
  std::set<std::pair<size_t, size_t>> pairs;
  for (const auto& [slot, list] : by_slot)
    for (size_t x = 0; x < list.size(); ++x)
      for (size_t y = x + 1; y < list.size(); ++y)
        if (list[x].first != list[y].first && conflict(list[x].second, list[y].second))
          pairs.insert(std::minmax(list[x].first, list[y].first));
  return {pairs.begin(), pairs.end()};
}

// The counters alone (not the queues) must order every pair of conflicting accesses: one task
// waits, transitively, on a counter the other releases. That is race freedom for any timing.
TEST_P(BackwardPlanInvariants, CountersOrderEveryConflictingAccess) {
  const auto pt = make_plan(GetParam());
  const auto tasks = queues(pt).all();
  const auto by_counter = releasers(pt, tasks);
  const size_t n = tasks.size();
  std::vector<std::vector<size_t>> inputs(n);  // tasks a task directly waits for
  for (size_t i = 0; i < n; ++i) {
    const auto w = task_wait(pt.plan, pt.segments(), tasks[i]);
    if (w.kind != BackwardCounterKind::none) inputs[i] = by_counter.at(counter_index(pt.plan, w.kind, w.at));
  }
  // before[b][a]: a happens before b. Memoized depth-first over the (acyclic) waits.
  std::vector<std::vector<bool>> before(n);
  std::function<const std::vector<bool>&(size_t)> ancestors = [&](size_t b) -> const std::vector<bool>& {
    if (!before[b].empty()) return before[b];
    std::vector<bool> set(n, false);
    for (size_t a : inputs[b]) {
      const auto& up = ancestors(a);
      for (size_t x = 0; x < n; ++x) set[x] = set[x] || up[x];
      set[a] = true;
    }
    before[b] = std::move(set);
    return before[b];
  };
  for (const auto& [a, b] : conflicting_pairs(pt, tasks))
    EXPECT_TRUE(ancestors(b)[a] || ancestors(a)[b])
        << describe(pt.plan, tasks[a]) << " races with " << describe(pt.plan, tasks[b]);
}

// A discrete-event run of the tickets: `num_comm` and `num_compute` CTAs take tickets in order
// as they become free, a task starts once its counter reached its target and takes cost(task).
struct TaskRun {
  BackwardTask task;
  double start = -1, end = -1;
};

template <class Cost>
std::vector<TaskRun> simulate(const PlanWithTable& pt, int num_comm, int num_compute, Cost&& cost) {
  const auto& p = pt.plan;
  const auto table = pt.segments();
  std::vector<int64_t> counters(counter_count(p), 0);
  std::vector<TaskRun> runs;
  const int64_t comm_total = comm_task_count(p), compute_total = compute_task_count(p, table);
  runs.reserve(comm_total + compute_total);
  std::map<int64_t, std::vector<size_t>> blocked;
  using Event = std::pair<double, size_t>;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> ends;
  int64_t tickets[2] = {0, 0};
  auto start = [&](size_t r, double now) {
    runs[r].start = now;
    runs[r].end = now + cost(runs[r].task);
    ends.push({runs[r].end, r});
  };
  auto take = [&](bool comm, double now) {
    int64_t& ticket = tickets[comm ? 0 : 1];
    if (ticket == (comm ? comm_total : compute_total)) return;
    runs.push_back({comm ? comm_task(p, ticket) : compute_task(p, table, ticket)});
    ++ticket;
    const size_t r = runs.size() - 1;
    const auto w = task_wait(p, table, runs[r].task);
    if (w.kind == BackwardCounterKind::none || counters[counter_index(p, w.kind, w.at)] >= w.target) {
      start(r, now);
    } else {
      blocked[counter_index(p, w.kind, w.at)].push_back(r);
    }
  };
  for (int i = 0; i < num_comm; ++i) take(true, 0);
  for (int i = 0; i < num_compute; ++i) take(false, 0);
  while (!ends.empty()) {
    const auto [now, done] = ends.top();
    ends.pop();
    for_each_release(pt, runs[done].task, [&](BackwardCounterKind kind, int64_t at) {
      const int64_t index = counter_index(p, kind, at);
      if (++counters[index] == counter_target(p, table, kind, at)) {
        for (size_t waiting : blocked[index]) start(waiting, now);
        blocked.erase(index);
      }
    });
    take(is_comm(runs[done].task.kind), now);
  }
  EXPECT_TRUE(blocked.empty()) << "deadlock: " << blocked.size() << " counters still awaited with " << num_comm
                               << " comm and " << num_compute << " compute CTAs";
  EXPECT_EQ(tickets[0], comm_total);
  EXPECT_EQ(tickets[1], compute_total);
  return runs;
}

TEST_P(BackwardPlanInvariants, RandomTimingsFinishWithoutOverlappingConflicts) {
  const auto pt = make_plan(GetParam());
  const auto tasks = queues(pt).all();
  const auto pairs = conflicting_pairs(pt, tasks);
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 12; ++trial) {
    const int comm = 1 + static_cast<int>(rng() % 3), compute = 1 + static_cast<int>(rng() % 6);
    std::map<BackwardTaskKind, double> scale;
    for (int k = 1; k <= static_cast<int>(BackwardTaskKind::wgrad); ++k)
      scale[static_cast<BackwardTaskKind>(k)] = 1 + static_cast<double>(rng() % 50);
    const auto runs = simulate(pt, comm, compute, [&](const BackwardTask& t) {
      return scale[t.kind] * (0.5 + static_cast<double>(rng() % 1000) / 1000);
    });
    ASSERT_EQ(runs.size(), tasks.size());
    // Each task ran once: the runs are the tasks, ticket for ticket.
    std::map<int64_t, const TaskRun*> by_position;
    std::vector<size_t> position(runs.size());
    size_t comm_seen = 0, compute_seen = 0;
    const size_t comm_total = static_cast<size_t>(comm_task_count(pt.plan));
    for (size_t r = 0; r < runs.size(); ++r) {
      const size_t at = is_comm(runs[r].task.kind) ? comm_seen++ : comm_total + compute_seen++;
      ASSERT_TRUE(same(runs[r].task, tasks[at])) << describe(pt.plan, runs[r].task);
      ASSERT_GE(runs[r].end, runs[r].start);
      position[at] = r;
    }
    for (const auto& [a, b] : pairs) {
      const TaskRun &x = runs[position[a]], &y = runs[position[b]];
      EXPECT_TRUE(x.end <= y.start || y.end <= x.start)
          << describe(pt.plan, x.task) << " overlaps " << describe(pt.plan, y.task) << " (comm " << comm << ", compute "
          << compute << ")";
    }
  }
}

BackwardCase random_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  BackwardCase c;
  c.tile_m = 1 + static_cast<int64_t>(rng() % 3);
  c.minibatch = c.tile_m * (1 + static_cast<int64_t>(rng() % 3));
  c.macrobatch = c.minibatch * (1 + static_cast<int64_t>(rng() % 3));
  const int experts = 1 + static_cast<int>(rng() % 5);
  for (int e = 0; e < experts; ++e) c.expert_rows.push_back(rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 9));
  c.mode = rng() % 2 ? ContextMode::replay : ContextMode::resident;
  c.shared = rng() % 2;
  return c;
}

std::vector<BackwardCase> cases() {
  const auto resident = ContextMode::resident, replay = ContextMode::replay;
  std::vector<BackwardCase> v{
      {2, 4, 8, {}, resident, true},            // no routed rows
      {2, 4, 8, {0, 0, 3}, replay, true},       // empty experts, less than a minibatch
      {2, 4, 8, {8}, resident, false},          // exactly one macrobatch
      {2, 4, 8, {20}, replay, false},           // one expert over three macrobatches (carry chain)
      {2, 4, 8, {5, 7, 1, 9}, resident, true},  // experts straddling steps and macrobatches
      {2, 2, 2, {3, 4, 0, 5}, replay, true},    // one minibatch per macrobatch: every step reuses
      {3, 6, 12, {13, 2, 8}, resident, true},   // tile_m 3
      {2, 4, 1024, {9, 11}, replay, false},     // the ring holds everything
  };
  for (uint64_t seed = 1; seed <= 24; ++seed) v.push_back(random_case(seed));
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, BackwardPlanInvariants, ::testing::ValuesIn(cases()));

// qwen3-30b-a3b at 16384 tokens per rank, EP=2: 64 local experts of about 2048 rows each (with
// padding just over the default 131072-row macrobatch, so one expert carries into a tiny second
// macrobatch), 128x256 tiles, 16 comm and 116 compute CTAs. Task costs follow their FLOPs at the
// forward's measured gate|up rate on the H200 (36 us per 128x256 tile over K = 2048) and 33 us per
// 128-row pull or push block. The bounded ring must cost little against one holding every row,
// and the span must stay near the compute CTAs' total work: no CTA role starves on the plan.
TEST(MegakernelBackwardPlan, BoundedRingCostsLittleAtQwen3Scale) {
  MegakernelConfig config;  // minibatch 4096, macrobatch 131072, tile_rows 128
  const MegakernelDims dims{2, 16384, 8, 2048, 768, 0, 64};
  std::vector<int64_t> offset{0};
  for (int64_t e = 0; e < 64; ++e) offset.push_back(offset.back() + (2048 - 60 + e * 37 % 120 + 127) / 128 * 128);
  struct Result {
    double span, work;
  };
  auto run = [&](int64_t macrobatch) {
    config.macrobatch_size = macrobatch;
    PlanWithTable pt;
    pt.plan =
        backward_trim_to_rows(build_backward_plan(config, {dims, ContextMode::resident, {256, 128}}), offset.back());
    EXPECT_TRUE(fits_capacity(pt.plan, offset.back()));
    pt.table = build_segment_table(pt.plan, offset);
    const double us_per_flop = 36.0 / (2.0 * 128 * 256 * 2048);
    double work = 0;
    auto cost = [&](const BackwardTask& t) {
      const auto tile_flops = [&](double k) { return 2.0 * 128 * 256 * k * us_per_flop; };
      switch (t.kind) {
        case BackwardTaskKind::dgd: return tile_flops(2048);
        case BackwardTaskKind::dx: return tile_flops(2 * 768);
        case BackwardTaskKind::wgrad: {
          const auto& g = pt.table.segments[t.segment];
          return tile_flops(static_cast<double>((g.last_tile - g.first_tile + 1) * 128));
        }
        default: return 33.0;
      }
    };
    for (int64_t i = 0; i < compute_task_count(pt.plan, pt.segments()); ++i)
      work += cost(compute_task(pt.plan, pt.segments(), i));
    double span = 0;
    for (const auto& r : simulate(pt, 16, 116, cost)) span = std::max(span, r.end);
    return Result{span, work / 116};
  };
  const Result bounded = run(131072), unbounded = run(262144);
  RecordProperty("bounded_over_unbounded", std::to_string(bounded.span / unbounded.span));
  RecordProperty("bounded_over_compute_work", std::to_string(bounded.span / bounded.work));
  EXPECT_LE(bounded.span, 1.05 * unbounded.span) << "bounded " << bounded.span << " us, unbounded " << unbounded.span;
  EXPECT_LE(bounded.span, 1.15 * bounded.work)
      << "span " << bounded.span << " us, compute work per CTA " << bounded.work;
}

TEST(MegakernelBackwardPlan, TilesFollowTheTiling) {
  MegakernelConfig config;  // tile_rows 128
  const MegakernelDims dims{2, 16384, 8, 2048, 768, 512, 64};
  const auto p = build_backward_plan(config, {dims, ContextMode::replay, {256, 128}});
  EXPECT_EQ(p.dgd_col_tiles, 3);      // I 768 / 256
  EXPECT_EQ(p.dx_col_tiles, 8);       // H 2048 / 256
  EXPECT_EQ(p.gate_up_col_tiles, 6);  // I 768 / 128 per matrix
  EXPECT_EQ(p.wgrad_gate_up_tiles, 6 * 16);
  EXPECT_EQ(p.wgrad_down_tiles, 16 * 3);
  EXPECT_EQ(p.shared_dgd_col_tiles, 2);
  EXPECT_EQ(p.shared_row_tiles, 128);
  EXPECT_EQ(carry_elements(p), 3 * 768 * 2048);
  try {
    build_backward_plan(config, {dims, ContextMode::resident, {0, 128}});
    ADD_FAILURE() << "tile_n 0 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("tile_n"), std::string::npos) << e.what();
  }
}

}  // namespace
