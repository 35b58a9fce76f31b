// The backward megakernel at EP = 2 with both ranks on one GPU (BackwardCase:
// megakernel_backward_case.hpp; the EP = 1 cases in test_megakernel_backward.cpp).

#include "megakernel_backward_case.hpp"

namespace moka::cuda {
namespace {

// ---- Two ranks on one GPU (EP = 2) ------------------------------------------------------------
//
// Each rank's call gets half the SMs. The two kernels never wait on each other (pulls read
// buffers the opening barrier froze, pushes land in slots read after the closing barrier), so
// they are correct run one after the other too; the CTA count lets both grids be resident at
// once, so the pushes of one rank land while the other computes, as on two GPUs. The barrier
// kernels do wait on each other, so these tests cannot run under compute-sanitizer (it
// serializes kernels: every barrier times out); the sanitizers cover the EP = 1 cases. Run
// alone in a fresh process (as ctest runs each test), the first test here also checks that
// MegakernelBackward loads its kernels before a call (load_megakernel_backward_kernels): a
// lazily loaded kernel's first launch waited out the other rank's 10 s barrier.
int ctas_per_rank() {
  int device = 0, sms = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int per_rank = sms / 2;
  EXPECT_GE(megakernel_backward_ctas_per_sm() * sms, 2 * per_rank) << "both ranks' grids resident at once";
  return per_rank;
}

// H = 320, I = 264 (two dgd and dx column tiles, partial last tiles), Is = 136, 8 experts (4 per
// rank), k = 2, T = 300 tokens per rank.
const MoeShape kTwoRankShape{320, 264, 8, 2, 136, Activation::swiglu, 0.5f};
constexpr int64_t kTwoRankTokens = 300;

BackwardCase two_rank_case(std::vector<int32_t> ids, uint64_t seed) {
  return BackwardCase(kTwoRankShape, 2, kTwoRankTokens, std::move(ids), seed);
}
BackwardCase two_rank_uniform(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return two_rank_case(uniform_routing(2 * kTwoRankTokens, 2, 8, rng), seed);
}

TEST(MegakernelBackwardTwoRanks, UniformRoutingMatchesReferenceInBothModes) {
  BackwardCase c = two_rank_uniform(0xbac2001ull);
  const int ctas = ctas_per_rank();
  c.expect_close(c.run_all(config(1, 128, 256), ctas));
  c.expect_close(c.run_all(config(2, 128, 256), ctas, core::ContextMode::replay));
}

// Every route of both ranks to rank 0's experts: rank 0 receives all 1200 rows, rank 1 none (it
// runs only the shared expert, pushes nothing and zeroes its experts' gradients), yet its d_x
// and d_topk_weights come back from rank 0.
TEST(MegakernelBackwardTwoRanks, AllRoutesToOneRankAndARankReceivingNothing) {
  std::mt19937_64 rng(0xbac2002ull);
  BackwardCase c = two_rank_case(uniform_routing(2 * kTwoRankTokens, 2, 4, rng), 0xbac2002ull);
  ASSERT_EQ(c.rows(1), 0);
  const int ctas = ctas_per_rank();
  c.expect_close(c.run_all(config(1, 128, 256), ctas));
  c.expect_close(c.run_all(config(1, 128, 256), ctas, core::ContextMode::replay));
}

// Both ranks' choice 0 on expert 4 (rank 1's first): 600 rows over three 256-row macrobatches
// (weight-gradient carries), expert 6 empty, rank 0 receiving nothing.
TEST(MegakernelBackwardTwoRanks, OneExpertOfTheOtherRankCarriesAcrossMacrobatches) {
  std::mt19937_64 rng(0xbac2003ull);
  std::vector<int32_t> ids;
  for (int r = 0; r < 2; ++r)
    for (int32_t id : skewed_routing(rng)) ids.push_back(id + 4);
  BackwardCase c = two_rank_case(ids, 0xbac2003ull);
  ASSERT_EQ(c.rows(0), 0);
  ASSERT_EQ(c.schedule(1).expert_offset, (std::vector<int64_t>{0, 640, 896, 896, 1408}));
  c.expect_close(c.run_all(config(1, 128, 256), ctas_per_rank()));
}

TEST(MegakernelBackwardTwoRanks, BitsDoNotDependOnSplitsOrBatchSizes) {
  BackwardCase c = two_rank_uniform(0xbac2004ull);
  const int ctas = ctas_per_rank();
  const std::vector<Gradients> first = c.run_all(config(1, 128, 256), ctas);
  c.expect_close(first);
  const std::vector<std::pair<std::vector<Gradients>, const char*>> others = {
      {c.run_all(config(2, 256, 512), 9), "2 + 7 CTAs per rank, minibatch 256, macrobatch 512"},
      {c.run_all(config(3, 128, 1024), ctas - 20), "fewer CTAs per rank, one macrobatch"},
      {c.run_all(config(1, 128, 256), ctas), "the same run again"}};
  for (const auto& [grads, what] : others)
    for (int r = 0; r < 2; ++r) EXPECT_TRUE(same_bits(first[r], grads[r])) << "rank " << r << ": " << what;
  // Replay's bits across splits too.
  const std::vector<Gradients> replay = c.run_all(config(1, 128, 256), ctas, core::ContextMode::replay);
  const std::vector<Gradients> replay_other = c.run_all(config(2, 256, 512), 9, core::ContextMode::replay);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(same_bits(replay[r], replay_other[r])) << "replay, rank " << r;
}

// Each rank raised a timeout whose message holds every one of `parts`.
void expect_timeouts(const std::vector<RankResult>& results, std::initializer_list<const char*> parts) {
  for (size_t r = 0; r < results.size(); ++r) {
    if (!results[r].error) {
      ADD_FAILURE() << "rank " << r << " reported no failure";
      continue;
    }
    try {
      std::rethrow_exception(results[r].error);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::timeout) << "rank " << r << ": " << e.what();
      for (const char* part : parts)
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
            << "rank " << r << ", no '" << part << "' in: " << e.what();
    }
  }
}

// Rank 1 starts 2 s late with a 0.5 s bound: rank 0's barriers time out (its kernel pulls and
// pushes nothing) and both ranks raise a timeout naming rank 1, rank 1 from rank 0's status slot
// once it arrives; neither waits longer than the bound plus the delay. The next call works.
TEST(MegakernelBackwardTwoRanks, ARankThatStopsIsReportedByEveryRank) {
  BackwardCase c = two_rank_uniform(0xbac2005ull);
  const int ctas = ctas_per_rank();
  const auto start = std::chrono::steady_clock::now();
  expect_timeouts(c.run_ranks(config(1, 128, 256, 0.5), {ctas, 1, 2000}), {"rank 0: rank 1 did not arrive"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
  c.expect_close(c.run_all(config(1, 128, 256), ctas));
}

// Rank 1's kernel bounds its waits by 1 ns: a wait not satisfied at its first read times out
// there, while rank 0 runs to the end. Both ranks raise rank 1's timeout naming its task and
// counter (its status slot carries the wait report).
TEST(MegakernelBackwardTwoRanks, APeersTimedOutWaitIsReportedByEveryRank) {
  BackwardCase c = two_rank_uniform(0xbac2006ull);
  const int ctas = ctas_per_rank();
  expect_timeouts(c.run_ranks(config(1, 128, 256), {ctas, -1, 0, 1}), {"rank 1: ", "timed out after", "waiting for"});
  c.expect_close(c.run_all(config(1, 128, 256), ctas));
}

}  // namespace
}  // namespace moka::cuda
