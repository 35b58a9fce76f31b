// Matching phases: Birkhoff-von Neumann decomposition and greedy max-weight matchings.
// A phase is a (partial) permutation: each sender talks to at most one receiver and each
// receiver hears at most one sender, so a phase is incast-free by construction.
#pragma once
#include <cstdint>
#include <vector>

#include "sched/traffic.hpp"

namespace moka::sched {

struct Phase {
  std::vector<int> receiver_of;   // per sender, -1 when idle
  std::vector<int64_t> bytes_of;  // per sender, real bytes sent in this phase (padding excluded)
  int64_t weight = 0;             // bytes per matched pair including padding
};

// D padded (diagonal included) so that every row and column sums to D.max_line_sum().
TrafficMatrix pad_to_equal_line_sums(const TrafficMatrix& d);

// BvN: perfect matchings of the padded matrix, each subtracting its smallest entry, until
// nothing is left. The real bytes of all phases sum back to D exactly, and the weights sum to
// D.max_line_sum(). At most n^2 - 2n + 2 phases; phases carrying only padding are dropped.
std::vector<Phase> bvn_phases(const TrafficMatrix& d);

// Greedy: up to `budget` phases, each a greedy max-weight matching of what is left (largest
// entries first, ties to the shift (j - i) mod n then i) that subtracts its smallest entry.
// `residual` receives the bytes the budget did not cover.
std::vector<Phase> greedy_phases(const TrafficMatrix& d, int budget, TrafficMatrix& residual);

}  // namespace moka::sched
