// The CPU emulation of the forward megakernel: bitwise equal to the reference layer's forward
// for any routing, rank count, worker split, minibatch and macrobatch; counters reach their
// targets; macrobatch 0 stays resident for backward; failures are errors, never hangs.
#include <chrono>
#include <cstring>
#include <thread>

#include "cpu/megakernel_emulation.hpp"
#include "megakernel_fixture.hpp"

using namespace moka;
using namespace moka::test;
using cpu::MegakernelEmulationOptions;

namespace {

// H 8, I 6, 8 experts, k 2, shared 5: with tile_n 4 and down_tile_n 3 every GEMM has a partial
// column tile.
MoeShape shape(int64_t top_k = 2, Activation act = Activation::swiglu) { return {8, 6, 8, top_k, 5, act, 0.6f}; }

MegakernelEmulationOptions options(int comm, int compute, int64_t tile_m, int64_t minibatch, int64_t macrobatch) {
  MegakernelEmulationOptions o;
  o.config = emulation_config(comm, tile_m, minibatch, macrobatch);
  o.config.tile_n = 4;
  o.config.down_tile_n = 3;
  o.num_compute_workers = compute;
  return o;
}

template <typename T>
std::vector<Buffers<T>> rank_inputs(const MoeShape& s, int world, int64_t tokens, core::RoutingKind routing) {
  return random_rank_buffers<T>(s, world, tokens, 11, routing);
}

template <typename T>
void run_reference(const MoeShape& s, std::vector<Buffers<T>>& ranks) {
  run_reference_ranks(s, ranks, 4, [](MoeLayer& layer, Buffers<T>& b) {
    layer.forward(b.inputs(), b.weights(), b.out_view(), Stream{});
  });
}

template <typename T>
std::vector<cpu::MegakernelForwardResult<T>> run_megakernel(const MoeShape& s, std::vector<Buffers<T>>& ranks,
                                                            const MegakernelEmulationOptions& o) {
  std::vector<cpu::MegakernelForwardResult<T>> results(ranks.size());
  run_emulated_ranks(static_cast<int>(ranks.size()), [&](ProcessGroup& g) {
    auto& b = ranks[g.rank()];
    results[g.rank()] = cpu::megakernel_forward<T>(&g, s, b.inputs(), b.weights(), b.out_view(), o);
  });
  return results;
}

template <typename T>
void expect_same_outputs(const std::vector<Buffers<T>>& got, const std::vector<Buffers<T>>& want,
                         const std::string& what) {
  for (size_t r = 0; r < got.size(); ++r)
    EXPECT_EQ(std::memcmp(got[r].out.data(), want[r].out.data(), got[r].out.size() * sizeof(T)), 0)
        << what << ", rank " << r;
}

// Each counter ends at the number of tasks that release it, which is its target.
template <typename T>
void expect_counters_at_targets(const cpu::MegakernelForwardResult<T>& result) {
  const auto& p = result.saved.plan;
  std::vector<int64_t> expected(core::counter_count(p), 0);
  for (const auto& t : core::plan_order(p)) {
    const auto r = core::task_release(p, t);
    if (r.kind == core::CounterKind::none) continue;
    EXPECT_LE(++expected[core::counter_index(p, r)], r.target);
  }
  EXPECT_EQ(result.final_counters, expected);
}

template <typename T>
void expect_matches_reference(const MoeShape& s, int world, int64_t tokens, core::RoutingKind routing,
                              const MegakernelEmulationOptions& o) {
  auto reference = rank_inputs<T>(s, world, tokens, routing);
  auto megakernel = reference;
  run_reference(s, reference);
  const auto results = run_megakernel(s, megakernel, o);
  expect_same_outputs(megakernel, reference, "megakernel vs reference");
  for (const auto& result : results) expect_counters_at_targets(result);
}

class MegakernelMatchesReference : public ::testing::TestWithParam<std::tuple<int, core::RoutingKind>> {};

TEST_P(MegakernelMatchesReference, Bitwise) {
  const auto [world, routing] = GetParam();
  // 2 comm + 2 compute workers, minibatch 4, macrobatch 8: several ring reuses.
  const auto o = options(2, 2, 2, 4, 8);
  expect_matches_reference<double>(shape(), world, 13, routing, o);
  expect_matches_reference<float>(shape(2, Activation::swiglu_clamped), world, 13, routing, o);
}

INSTANTIATE_TEST_SUITE_P(Ranks, MegakernelMatchesReference,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(core::RoutingKind::uniform, core::RoutingKind::zipf,
                                                              core::RoutingKind::one_expert)));

TEST(Megakernel, AllTokensToOneExpert) {
  // k = 1 and one-expert routing: every token of every rank lands on expert 0 of rank 0.
  expect_matches_reference<double>(shape(1), 4, 9, core::RoutingKind::one_expert, options(1, 2, 2, 4, 8));
}

TEST(Megakernel, SingleToken) {
  expect_matches_reference<double>(shape(), 2, 1, core::RoutingKind::uniform, options(1, 1, 2, 2, 4));
  expect_matches_reference<float>(shape(), 1, 1, core::RoutingKind::uniform, options(2, 3, 4, 4, 4));
}

TEST(Megakernel, RankReceivingNothing) {
  const auto s = shape();
  auto reference = rank_inputs<double>(s, 2, 7, core::RoutingKind::uniform);
  // Only rank 0's experts (0..3) are chosen: rank 1 runs no routed task, only the shared expert.
  for (auto& b : reference)
    for (int64_t t = 0; t < b.tokens; ++t)
      for (int64_t j = 0; j < s.top_k; ++j) b.topk_ids[t * s.top_k + j] = static_cast<int32_t>((t + j) % 4);
  auto megakernel = reference;
  run_reference(s, reference);
  const auto results = run_megakernel(s, megakernel, options(2, 2, 2, 4, 8));
  EXPECT_EQ(results[1].saved.plan.total_rows, 0);
  EXPECT_GT(results[0].saved.plan.total_rows, 0);
  expect_same_outputs(megakernel, reference, "rank 1 receives nothing");
}

TEST(Megakernel, BitwiseAcrossWorkersMinibatchesAndMacrobatches) {
  const auto s = shape();
  const auto inputs = rank_inputs<float>(s, 2, 21, core::RoutingKind::zipf);
  auto reference = inputs;
  run_reference(s, reference);
  const std::vector<MegakernelEmulationOptions> configs{
      options(1, 1, 2, 2, 2),     // one minibatch per macrobatch: every step reuses the ring
      options(2, 3, 2, 4, 8),     // several minibatches per macrobatch
      options(3, 1, 4, 4, 16),    // tile_m 4
      options(1, 4, 2, 8, 1024),  // the ring holds every row
  };
  for (const auto& o : configs) {
    auto megakernel = inputs;
    const auto results = run_megakernel(s, megakernel, o);
    const auto& plan = results[0].saved.plan;
    if (o.config.macrobatch_size < 1024) EXPECT_GT(plan.num_macrobatches, 1) << "this config must reuse the ring";
    expect_same_outputs(megakernel, reference,
                        "comm " + std::to_string(o.config.num_comm_sms) + ", compute " +
                            std::to_string(o.num_compute_workers) + ", minibatch " +
                            std::to_string(o.config.minibatch_size) + ", macrobatch " +
                            std::to_string(o.config.macrobatch_size));
  }
}

// After forward the ring holds macrobatch 0 (grouped rows [0, ring_rows)), exactly the rows a
// ring large enough for everything holds there: the context backward reads.
TEST(Megakernel, MacrobatchZeroIsTheSavedContext) {
  const auto s = shape();
  auto small_ring = rank_inputs<double>(s, 2, 17, core::RoutingKind::uniform);
  auto whole_ring = small_ring;
  const auto small = run_megakernel(s, small_ring, options(2, 2, 2, 4, 8));
  const auto whole = run_megakernel(s, whole_ring, options(2, 2, 2, 4, 1024));
  for (size_t r = 0; r < small.size(); ++r) {
    const auto& a = small[r].saved;
    const auto& b = whole[r].saved;
    ASSERT_GT(a.plan.num_macrobatches, 1);
    ASSERT_EQ(b.plan.num_macrobatches, 1);
    const int64_t rows = a.plan.ring_rows, H = s.hidden, I = s.intermediate;
    EXPECT_TRUE(std::equal(a.ring_x.begin(), a.ring_x.end(), b.ring_x.begin()));
    EXPECT_EQ(a.ring_x.size(), static_cast<size_t>(rows * H));
    for (auto field : {&cpu::MegakernelSavedState<double>::ring_gate, &cpu::MegakernelSavedState<double>::ring_up,
                       &cpu::MegakernelSavedState<double>::ring_hidden}) {
      ASSERT_EQ((a.*field).size(), static_cast<size_t>(rows * I));
      EXPECT_TRUE(std::equal((a.*field).begin(), (a.*field).end(), (b.*field).begin())) << "rank " << r;
    }
    EXPECT_EQ(a.shared_hidden, b.shared_hidden);
    EXPECT_EQ(a.shared_hidden.size(), static_cast<size_t>(17 * s.shared_intermediate));
  }
}

TEST(Megakernel, CapacityOverflowIsAnErrorOnEveryRank) {
  const auto s = shape(1);
  auto ranks = rank_inputs<double>(s, 4, 16, core::RoutingKind::one_expert);  // 64 rows to rank 0
  auto o = options(1, 1, 2, 4, 8);
  o.config.capacity_multiplier = 0.25;  // room for 2*T*k routed rows
  try {
    run_megakernel(s, ranks, o);
    ADD_FAILURE() << "overflow not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::capacity_exceeded);
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("capacity_multiplier"), std::string::npos) << e.what();
  }
}

TEST(Megakernel, StalledWorkerIsATimeoutNamingTheStage) {
  const auto s = shape();
  auto ranks = rank_inputs<double>(s, 2, 16, core::RoutingKind::uniform);
  auto o = options(1, 1, 2, 4, 8);
  o.config.spin_timeout_seconds = 0.25;
  // Rank 1's only comm worker stalls on its first dispatch block: gate|up tiles wait in vain.
  o.before_task = [](int rank, const core::Task& t) {
    if (rank == 1 && t.kind == core::TaskKind::dispatch && t.step == 0 && t.row_tile == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  };
  expect_prompt_error([&] { run_megakernel(s, ranks, o); }, ErrorCode::timeout, {"rank 1", "gate_up", "rows_ready"});
}

TEST(Megakernel, BadConfigIsRejectedBeforeAnyWork) {
  const auto s = shape();
  auto ranks = rank_inputs<double>(s, 2, 4, core::RoutingKind::uniform);
  auto o = options(1, 1, 4, 6, 12);  // minibatch not a multiple of tile_m
  try {
    run_megakernel(s, ranks, o);
    ADD_FAILURE() << "bad config accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("minibatch_size"), std::string::npos) << e.what();
  }
  o = options(1, 0, 2, 4, 8);
  EXPECT_THROW(run_megakernel(s, ranks, o), Error);
}

}  // namespace
