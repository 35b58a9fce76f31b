// Synthetic routing for benchmarks, tests and simulations.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moka::core {

enum class RoutingKind : uint8_t {
  uniform,     // every expert equally likely
  zipf,        // Zipf expert popularity, exponent chosen to hit a target per-expert load Gini
  one_expert,  // every token's first choice is expert 0 (all tokens on one expert when k = 1)
};
RoutingKind parse_routing_kind(const std::string& name);  // "uniform" | "zipf" | "one-expert"

struct RoutingSpec {
  RoutingKind kind = RoutingKind::uniform;
  double gini = 0.3;  // zipf only
  uint64_t seed = 1;
  // Per-rank locality in [0, 1]: the share of a rank's expert choices drawn from the experts
  // its own rank hosts (experts are laid out contiguously, num_experts / world per rank).
  double locality = 0.0;
};

// Expert popularity (sums to 1) for `spec` over `num_experts`; popularity ranks are shuffled
// by the seed so the hot experts are not always the low ids.
std::vector<double> expert_popularity(const RoutingSpec& spec, int64_t num_experts);
// Gini coefficient of a non-negative vector (0 = equal, -> 1 = one holds everything).
double gini(const std::vector<double>& values);
// Zipf exponent whose expected per-expert load has the given Gini.
double zipf_exponent_for_gini(double target_gini, int64_t num_experts);

// Distinct top-k expert ids per token ([tokens * k]), drawn without replacement by popularity.
// `stream` separates the draws of different ranks sharing one spec.
std::vector<int32_t> sample_topk_ids(const RoutingSpec& spec, int64_t tokens, int64_t top_k, int64_t num_experts,
                                     uint64_t stream = 0);
// Popularity seen by `rank` of `world`: the global popularity mixed with `spec.locality` of
// the same popularity restricted to the experts hosted by `rank`.
std::vector<double> rank_expert_popularity(const RoutingSpec& spec, int64_t num_experts, int rank, int world);
// Top-k ids of one rank of `world`, with per-rank locality (equals sample_topk_ids when
// spec.locality is 0).
std::vector<int32_t> sample_rank_topk_ids(const RoutingSpec& spec, int64_t tokens, int64_t top_k, int64_t num_experts,
                                          int rank, int world);

}  // namespace moka::core
