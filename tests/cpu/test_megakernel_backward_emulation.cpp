// The CPU emulation of the backward megakernel against the CPU reference backward: d_x and the
// shared expert's gradients bitwise always; d_topk_weights bitwise while one column tile covers
// I; routed dW bitwise at one rank; the rest within a tight tolerance (the reference sums in
// another order, docs/MEGAKERNEL.md "Backward plan"). Every output is bitwise the same across
// worker splits, minibatch and macrobatch sizes and both context modes; counters reach their
// targets; failures are errors naming the problem, never hangs.
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "cpu/megakernel_backward_emulation.hpp"
#include "megakernel_fixture.hpp"

using namespace moka;
using namespace moka::test;
using core::ContextMode;
using cpu::MegakernelBackwardOptions;

namespace {

// H 8, I 6, 8 experts, k 2, shared 5 (or none).
MoeShape shape(int64_t top_k = 2, Activation act = Activation::swiglu, int64_t shared = 5) {
  return {8, 6, 8, top_k, shared, act, 0.6f};
}

MegakernelBackwardOptions options(ContextMode mode, int comm, int compute, int64_t minibatch, int64_t macrobatch,
                                  core::BackwardTiling tiling = {8, 3}) {
  MegakernelBackwardOptions o;
  o.config = emulation_config(comm, 2, minibatch, macrobatch);
  o.mode = mode;
  o.tiling = tiling;
  o.num_compute_workers = compute;
  return o;
}

template <typename T>
void run_reference(const MoeShape& s, std::vector<Buffers<T>>& ranks) {
  run_reference_ranks(s, ranks, 2, [](MoeLayer& layer, Buffers<T>& b) { run_layer(layer, b); });
}

// The forward emulation (its ring holding every row, the resident context) then the backward.
template <typename T>
std::vector<cpu::MegakernelBackwardResult> run_megakernel(const MoeShape& s, std::vector<Buffers<T>>& ranks,
                                                          const MegakernelBackwardOptions& o,
                                                          int64_t forward_macrobatch = 1024) {
  cpu::MegakernelEmulationOptions forward;
  forward.config = o.config;
  forward.config.tile_n = 4;
  forward.config.macrobatch_size = forward_macrobatch;
  std::vector<cpu::MegakernelBackwardResult> results(ranks.size());
  run_emulated_ranks(static_cast<int>(ranks.size()), [&](ProcessGroup& g) {
    auto& b = ranks[g.rank()];
    const auto saved = cpu::megakernel_forward<T>(&g, s, b.inputs(), b.weights(), b.out_view(), forward).saved;
    results[g.rank()] =
        cpu::megakernel_backward<T>(&g, s, b.inputs(), b.weights(), saved, b.d_out_view(), b.gradients(), o);
  });
  return results;
}

// LayerBuffers::outputs(), in order.
enum Output : size_t { kOut, kDx, kDTopkWeights, kDwGate, kDwUp, kDwDown, kDwsGate, kDwsUp, kDwsDown };
const char* const kOutputNames[] = {"out",      "d_x",       "d_topk_weights", "d_w_gate", "d_w_up",
                                    "d_w_down", "d_ws_gate", "d_ws_up",        "d_ws_down"};

// Which outputs besides d_x, out and the shared expert's gradients must be bitwise equal.
struct Exact {
  bool d_topk_weights, routed_dw;
};

template <typename T>
void expect_outputs(const std::vector<Buffers<T>>& got, const std::vector<Buffers<T>>& want, Exact exact,
                    const std::string& what) {
  const double rtol = std::is_same_v<T, double> ? 1e-12 : 2e-5;
  for (size_t r = 0; r < got.size(); ++r) {
    const auto a = got[r].outputs(), b = want[r].outputs();
    for (size_t i = 0; i < a.size(); ++i) {
      const bool routed_dw = i >= kDwGate && i <= kDwDown;
      const bool bitwise = (i != kDTopkWeights || exact.d_topk_weights) && (!routed_dw || exact.routed_dw);
      ASSERT_EQ(a[i]->size(), b[i]->size());
      if (bitwise) {
        // Empty outputs (no shared expert) have null data, which memcmp may not be given.
        EXPECT_TRUE(a[i]->empty() || std::memcmp(a[i]->data(), b[i]->data(), a[i]->size() * sizeof(T)) == 0)
            << what << ", rank " << r << ": " << kOutputNames[i] << " not bitwise equal";
        continue;
      }
      double scale = 0;
      for (T v : *b[i]) scale = std::max(scale, std::abs(static_cast<double>(v)));
      for (size_t n = 0; n < a[i]->size(); ++n) {
        const double x = (*a[i])[n], y = (*b[i])[n];
        ASSERT_LE(std::abs(x - y), rtol * (std::abs(y) + scale))
            << what << ", rank " << r << ": " << kOutputNames[i] << "[" << n << "] " << x << " vs " << y;
      }
    }
  }
}

// Each counter ends at the number of releases the plan makes, which is its target.
void expect_counters_at_targets(const cpu::MegakernelBackwardResult& result) {
  const auto& p = result.plan;
  const auto table = result.segments.view();
  std::vector<int64_t> expected(core::counter_count(p), 0);
  auto count = [&](const core::BackwardTask& t) {
    for (const auto& range : core::task_releases(p, table, t).range)
      for (int64_t at = range.first; at <= range.last && range.kind != core::BackwardCounterKind::none; ++at)
        ++expected[core::counter_index(p, range.kind, at)];
  };
  for (int64_t i = 0; i < core::comm_task_count(p); ++i) count(core::comm_task(p, i));
  for (int64_t i = 0; i < core::compute_task_count(p, table); ++i) count(core::compute_task(p, table, i));
  EXPECT_EQ(result.final_counters, expected);
}

template <typename T>
void expect_matches_reference(const MoeShape& s, int world, int64_t tokens, core::RoutingKind routing,
                              const MegakernelBackwardOptions& o) {
  auto reference = random_rank_buffers<T>(s, world, tokens, 5, routing);
  auto megakernel = reference;
  run_reference(s, reference);
  const auto results = run_megakernel(s, megakernel, o);
  const bool one_column_tile = o.tiling.tile_n >= s.intermediate;
  expect_outputs(megakernel, reference, {one_column_tile, world == 1},
                 std::string(core::to_string(o.mode)) + ", " + std::to_string(world) + " ranks");
  for (const auto& result : results) expect_counters_at_targets(result);
}

class MegakernelBackwardMatchesReference
    : public ::testing::TestWithParam<std::tuple<int, core::RoutingKind, ContextMode>> {};

TEST_P(MegakernelBackwardMatchesReference, BitwiseWhereTheOrderAllows) {
  const auto [world, routing, mode] = GetParam();
  // Minibatch 4, macrobatch 8 (rows of tile 2): several ring reuses and carried experts.
  expect_matches_reference<double>(shape(), world, 13, routing, options(mode, 2, 2, 4, 8));
  expect_matches_reference<float>(shape(2, Activation::swiglu_clamped, 0), world, 13, routing,
                                  options(mode, 1, 3, 4, 8));
  // Two column tiles over I: d_topk_weights sums two partials.
  expect_matches_reference<double>(shape(), world, 9, routing, options(mode, 2, 2, 4, 8, {4, 3}));
}

std::string case_name(const ::testing::TestParamInfo<MegakernelBackwardMatchesReference::ParamType>& info) {
  const char* routings[] = {"uniform", "zipf", "one_expert"};
  return "ep" + std::to_string(std::get<0>(info.param)) + "_" + routings[static_cast<int>(std::get<1>(info.param))] +
         "_" + core::to_string(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Ranks, MegakernelBackwardMatchesReference,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(core::RoutingKind::uniform, core::RoutingKind::zipf,
                                                              core::RoutingKind::one_expert),
                                            ::testing::Values(ContextMode::resident, ContextMode::replay)),
                         case_name);

TEST(MegakernelBackward, AllTokensToOneExpertCarriesAcrossMacrobatches) {
  // k = 1 and one-expert routing: every token of every rank on expert 0 of rank 0, whose rows
  // span every macrobatch (a chain of carries).
  const auto o = options(ContextMode::replay, 1, 2, 4, 8);
  auto reference = random_rank_buffers<double>(shape(1), 4, 9, 5, core::RoutingKind::one_expert);
  auto megakernel = reference;
  run_reference(shape(1), reference);
  const auto results = run_megakernel(shape(1), megakernel, o);
  EXPECT_GE(results[0].plan.num_macrobatches, 4);
  int carried = 0;
  for (const auto& segment : results[0].segments.segments) carried += segment.carry_out;
  EXPECT_GE(carried, 3);
  expect_outputs(megakernel, reference, {true, false}, "one expert");
  expect_matches_reference<double>(shape(1), 1, 21, core::RoutingKind::one_expert, o);
}

TEST(MegakernelBackward, OtherShapesAndTiles) {
  // Three column tiles over I and H, a partial dW tile everywhere, k 3, tile_rows 4.
  auto o = options(ContextMode::replay, 2, 3, 8, 16, {8, 5});
  o.config.tile_rows = 4;
  expect_matches_reference<double>({16, 20, 4, 3, 12, Activation::swiglu, 0.6f}, 2, 11, core::RoutingKind::zipf, o);
  o.mode = ContextMode::resident;
  expect_matches_reference<float>({16, 20, 4, 3, 12, Activation::swiglu_clamped, 0.6f}, 1, 11,
                                  core::RoutingKind::uniform, o);
  // 16 experts, k 4, I smaller than one column tile.
  expect_matches_reference<double>({12, 4, 16, 4, 0, Activation::swiglu, 0.6f}, 4, 5, core::RoutingKind::uniform,
                                   options(ContextMode::resident, 1, 2, 2, 4, {6, 4}));
}

TEST(MegakernelBackward, SingleTokenAndNoShared) {
  expect_matches_reference<double>(shape(), 2, 1, core::RoutingKind::uniform,
                                   options(ContextMode::resident, 1, 1, 2, 4));
  expect_matches_reference<float>(shape(2, Activation::swiglu, 0), 1, 1, core::RoutingKind::uniform,
                                  options(ContextMode::replay, 2, 3, 4, 4));
}

TEST(MegakernelBackward, RankReceivingNothingHasZeroExpertGradients) {
  const auto s = shape();
  auto reference = random_rank_buffers<double>(s, 2, 7, 5, core::RoutingKind::uniform);
  // Only rank 0's experts (0..3) are chosen: rank 1 runs no routed task, only the shared expert.
  for (auto& b : reference)
    for (int64_t t = 0; t < b.tokens; ++t)
      for (int64_t j = 0; j < s.top_k; ++j) b.topk_ids[t * s.top_k + j] = static_cast<int32_t>((t + j) % 4);
  auto megakernel = reference;
  run_reference(s, reference);
  const auto results = run_megakernel(s, megakernel, options(ContextMode::resident, 2, 2, 4, 8));
  EXPECT_EQ(results[1].plan.total_rows, 0);
  for (double v : megakernel[1].d_w_gate) ASSERT_EQ(v, 0.0);
  expect_outputs(megakernel, reference, {true, false}, "rank 1 receives nothing");
}

// EP = 2 with every route crossing ranks (rank r's tokens on rank 1 - r's experts): every row
// is pulled from and pushed to the other rank, and each expert's rows come from one source in
// slot order, the reference's order, so every output, routed dW included, is bitwise the
// reference's in both modes and with carries across macrobatches.
TEST(MegakernelBackward, CrossRankRoutesAreBitwiseTheReference) {
  const auto s = shape();
  for (const auto mode : {ContextMode::resident, ContextMode::replay}) {
    auto reference = random_rank_buffers<double>(s, 2, 13, 5, core::RoutingKind::uniform);
    for (size_t r = 0; r < reference.size(); ++r)
      for (int64_t t = 0; t < reference[r].tokens; ++t)
        for (int64_t j = 0; j < s.top_k; ++j)
          reference[r].topk_ids[t * s.top_k + j] = static_cast<int32_t>((1 - r) * 4 + (t + j) % 4);
    auto megakernel = reference;
    run_reference(s, reference);
    const auto results = run_megakernel(s, megakernel, options(mode, 2, 2, 4, 8));
    for (const auto& result : results) EXPECT_GT(result.plan.num_macrobatches, 1);
    expect_outputs(megakernel, reference, {true, true}, std::string("cross-rank routes, ") + core::to_string(mode));
  }
}

TEST(MegakernelBackward, BitwiseAcrossWorkersMinibatchesMacrobatchesAndModes) {
  const auto s = shape();
  const auto inputs = random_rank_buffers<float>(s, 2, 21, 5, core::RoutingKind::zipf);
  auto reference = inputs;
  run_reference(s, reference);
  const core::BackwardTiling two_tiles{4, 3};
  std::vector<Buffers<float>> first;
  for (const auto mode : {ContextMode::resident, ContextMode::replay}) {
    for (const auto& o : {options(mode, 1, 1, 2, 2, two_tiles),      // every step reuses the ring
                          options(mode, 2, 3, 4, 8, two_tiles),      // several minibatches per macrobatch
                          options(mode, 3, 1, 8, 16, two_tiles),     // larger steps
                          options(mode, 1, 4, 4, 1024, two_tiles)})  // the ring holds every row
    {
      auto megakernel = inputs;
      const auto results = run_megakernel(s, megakernel, o);
      if (o.config.macrobatch_size < 1024) EXPECT_GT(results[0].plan.num_macrobatches, 1);
      const std::string what = std::string(core::to_string(mode)) + ", comm " + std::to_string(o.config.num_comm_sms) +
                               ", compute " + std::to_string(o.num_compute_workers) + ", minibatch " +
                               std::to_string(o.config.minibatch_size) + ", macrobatch " +
                               std::to_string(o.config.macrobatch_size);
      expect_outputs(megakernel, reference, {false, false}, what + " vs reference");
      if (first.empty()) {
        first = megakernel;
      } else {
        expect_outputs(megakernel, first, {true, true}, what + " vs the first config");
      }
    }
  }
}

TEST(MegakernelBackward, ResidentModeNeedsEveryRowInTheForwardRing) {
  const auto s = shape();
  auto ranks = random_rank_buffers<double>(s, 2, 16, 5, core::RoutingKind::uniform);
  try {
    run_megakernel(s, ranks, options(ContextMode::resident, 1, 1, 4, 8), /*forward_macrobatch=*/8);
    ADD_FAILURE() << "resident backward accepted a partial ring";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("replay mode"), std::string::npos) << e.what();
  }
  // Replay needs only the schedule.
  auto reference = random_rank_buffers<double>(s, 2, 16, 5, core::RoutingKind::uniform);
  auto megakernel = reference;
  run_reference(s, reference);
  run_megakernel(s, megakernel, options(ContextMode::replay, 1, 1, 4, 8), 8);
  expect_outputs(megakernel, reference, {true, false}, "replay after a partial forward ring");
}

TEST(MegakernelBackward, StalledWorkerIsATimeoutNamingTheTask) {
  const auto s = shape();
  auto ranks = random_rank_buffers<double>(s, 2, 16, 5, core::RoutingKind::uniform);
  auto o = options(ContextMode::resident, 1, 1, 4, 8);
  o.config.spin_timeout_seconds = 0.25;
  // Rank 1's only comm worker stalls on its first pull: the dgd tiles wait in vain.
  o.before_task = [](int rank, const core::BackwardTask& t) {
    if (rank == 1 && t.kind == core::BackwardTaskKind::pull && t.step == 0 && t.row_tile == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  };
  expect_prompt_error([&] { run_megakernel(s, ranks, o); }, ErrorCode::timeout, {"rank 1", "dgd", "rows_ready"});
}

}  // namespace
