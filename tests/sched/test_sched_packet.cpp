#include <gtest/gtest.h>

#include "determinism.hpp"
#include "moka/error.hpp"
#include "sched/packet_sim.hpp"
#include "sched_fixtures.hpp"

using namespace moka::sched;
using namespace moka::sched::testing;

namespace {
const Fabric kFabric = [] {
  Fabric f;
  f.gpus = 32;
  return f;
}();
const TrafficMatrix& skewed() {
  static const TrafficMatrix d = zipf_matrix(32, 0.35, 3, 256);
  return d;
}
int senders_to(const TrafficMatrix& d, int j) {
  int s = 0;
  for (int i = 0; i < d.n; ++i) s += d.at(i, j) > 0;
  return s;
}
PacketOptions packets(double buffer, BackPressure mode) {
  PacketOptions o;
  o.chunk_bytes = 64 << 10;
  o.buffer_bytes = buffer;
  o.mode = mode;
  return o;
}
}  // namespace

TEST(SchedPacket, RateBasedQueueStaysWithinOneChunkPerSender) {
  const auto& d = skewed();
  const auto o = packets(0, BackPressure::credit);
  const auto r = simulate_packets(Policy::rate_based, d, kFabric, {}, o);
  for (int j = 0; j < d.n; ++j) EXPECT_LE(r.peak_queue[j], senders_to(d, j) * static_cast<double>(o.chunk_bytes)) << j;
  EXPECT_LT(r.completion_over_tstar(), 1.02);
  const auto rr = simulate_packets(Policy::round_robin, d, kFabric, {}, o);
  EXPECT_GT(rr.peak_hot_queue(), 10 * r.peak_hot_queue());
}

TEST(SchedPacket, CreditsNeverOverfillABufferAndPfcPausesRoundRobin) {
  const auto& d = skewed();
  const double buffer = 4.0 * (64 << 10);
  for (Policy p : {Policy::rate_based, Policy::round_robin, Policy::spreadout, Policy::bvn}) {
    const auto r = simulate_packets(p, d, kFabric, {}, packets(buffer, BackPressure::credit));
    for (double q : r.peak_queue) EXPECT_LE(q, buffer) << to_string(p);
    EXPECT_GE(r.completion_over_tstar(), 1.0);
  }
  const auto rr = simulate_packets(Policy::round_robin, d, kFabric, {}, packets(buffer, BackPressure::pfc));
  const auto rate = simulate_packets(Policy::rate_based, d, kFabric, {}, packets(buffer, BackPressure::pfc));
  EXPECT_GT(rr.pause_s, 0.0);
  EXPECT_GT(rr.completion_s, rate.completion_s);  // head-of-line blocking stalls the cold flows
}

TEST(SchedPacket, UniformTrafficFinishesNearTStarUnderEveryChunkPolicy) {
  const auto d = uniform_matrix(16, 4 << 20);
  Fabric f;
  f.gpus = 16;
  auto o = packets(1 << 20, BackPressure::credit);
  o.propagation_s = 0;  // phased policies pay the delivery latency once per phase
  for (Policy p : all_policies()) {
    if (p == Policy::max_min_fair) continue;  // fluid only
    const auto r = simulate_packets(p, d, f, {}, o);
    EXPECT_LT(r.completion_over_tstar(), 1.02) << to_string(p);
  }
  EXPECT_THROW(simulate_packets(Policy::max_min_fair, d, f, {}, packets(0, BackPressure::credit)), moka::Error);
}

TEST(SchedPacket, SimulationIsDeterministic) {
  const auto o = packets(8 << 20, BackPressure::pfc);
  // Each run draws its matrix anew and simulates the policies in turn.
  const auto simulations = [&] {
    const auto d = zipf_matrix(32, 0.35, 3, 256);
    std::vector<double> flat;
    for (Policy p : {Policy::rate_based, Policy::round_robin, Policy::greedy_matching}) {
      const auto r = simulate_packets(p, d, kFabric, {}, o);
      flat.insert(flat.end(), {r.completion_s, r.pause_s, double(r.phases)});
      flat.insert(flat.end(), r.peak_queue.begin(), r.peak_queue.end());
      flat.insert(flat.end(), r.mean_queue.begin(), r.mean_queue.end());
    }
    return flat;
  };
  const auto runs = moka::testing::concurrent_runs(simulations);
  for (size_t r = 1; r < runs.size(); ++r) EXPECT_EQ(runs[r], runs[0]) << "run " << r;
}
