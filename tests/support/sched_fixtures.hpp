// Traffic matrices shared by the scheduling tests.
#pragma once
#include <algorithm>
#include <numeric>
#include <random>

#include "sched/traffic.hpp"

namespace moka::sched::testing {

// The research note's counterexample at rate 1, in half units (bytes 4 = 2 units, 1 = 0.5
// units, 2 bytes/s = rate 1): senders 0-2 each send 2 units to the hot receiver 3 and 0.5
// units to each of four private receivers (4 + 4i .. 7 + 4i).
inline TrafficMatrix incast_counterexample() {
  TrafficMatrix d(16);
  for (int i = 0; i < 3; ++i) {
    d.at(i, 3) = 4;
    for (int p = 0; p < 4; ++p) d.at(i, 4 + 4 * i + p) = 1;
  }
  return d;
}
inline Fabric unit_fabric(int gpus, double bw = 2.0) {
  Fabric f;
  f.gpus = gpus, f.link_bw = bw;
  return f;
}

inline TrafficMatrix uniform_matrix(int n, int64_t bytes) {
  TrafficMatrix d(n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      if (i != j) d.at(i, j) = bytes;
  return d;
}

// A random derangement (no fixed point), each pair carrying `bytes`.
inline TrafficMatrix permutation_matrix(int n, int64_t bytes, uint64_t seed) {
  std::vector<int> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  do std::shuffle(perm.begin(), perm.end(), rng);
  while ([&] {
    for (int i = 0; i < n; ++i)
      if (perm[i] == i) return true;
    return false;
  }());
  TrafficMatrix d(n);
  for (int i = 0; i < n; ++i) d.at(i, perm[i]) = bytes;
  return d;
}

inline TrafficMatrix zipf_matrix(int gpus, double gini, uint64_t seed, int64_t tokens = 512) {
  SyntheticTraffic s;
  s.gpus = gpus;
  s.tokens_per_rank = tokens;
  s.routing = {core::RoutingKind::zipf, gini, seed, 0.0};
  return synthetic_traffic(s);
}

}  // namespace moka::sched::testing
