#include "core/routing_gen.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "moka/error.hpp"

namespace moka::core {

RoutingKind parse_routing_kind(const std::string& name) {
  if (name == "uniform") return RoutingKind::uniform;
  if (name == "zipf") return RoutingKind::zipf;
  if (name == "one-expert") return RoutingKind::one_expert;
  throw Error(ErrorCode::invalid_argument, "unknown routing '" + name + "' (uniform, zipf, one-expert)");
}

double gini(const std::vector<double>& values) {
  std::vector<double> v(values);
  std::sort(v.begin(), v.end());
  const double n = static_cast<double>(v.size());
  const double total = std::accumulate(v.begin(), v.end(), 0.0);
  if (v.empty() || total <= 0) return 0.0;
  double weighted = 0;
  for (size_t i = 0; i < v.size(); ++i) weighted += (2.0 * (i + 1) - n - 1) * v[i];
  return weighted / (n * total);
}

namespace {
std::vector<double> zipf_weights(double s, int64_t n) {
  std::vector<double> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = 1.0 / std::pow(static_cast<double>(i + 1), s);
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  for (auto& x : w) x /= total;
  return w;
}
}  // namespace

double zipf_exponent_for_gini(double target, int64_t n) {
  require(target >= 0 && target < 1, ErrorCode::invalid_argument, "target Gini must be in [0, 1)");
  double lo = 0, hi = 16;  // Gini grows monotonically with the exponent
  for (int it = 0; it < 100; ++it) {
    const double mid = 0.5 * (lo + hi);
    (gini(zipf_weights(mid, n)) < target ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

std::vector<double> expert_popularity(const RoutingSpec& spec, int64_t n) {
  std::vector<double> p(n, 1.0 / static_cast<double>(n));
  if (spec.kind == RoutingKind::zipf) {
    p = zipf_weights(zipf_exponent_for_gini(spec.gini, n), n);
    std::mt19937_64 rng(spec.seed * 0x9E3779B97F4A7C15ULL + 17);
    std::shuffle(p.begin(), p.end(), rng);
  }
  return p;
}

namespace {
// Distinct top-k ids drawn without replacement from `pop`: drawing from the full distribution
// and redrawing repeats is the same law as renormalising over the remaining experts, and it
// costs O(k) per token instead of O(num_experts), which replaying 1024 ranks needs.
std::vector<int32_t> draw_topk(const std::vector<double>& pop, bool first_is_expert0, int64_t tokens, int64_t k,
                               uint64_t seed) {
  const auto n = static_cast<int64_t>(pop.size());
  require(k <= n, ErrorCode::invalid_argument, "top_k exceeds the number of experts");
  const auto positive = std::count_if(pop.begin(), pop.end(), [](double p) { return p > 0; });
  require(positive >= k, ErrorCode::invalid_argument, "fewer experts with positive popularity than top_k");
  std::vector<int32_t> ids(tokens * k);
  std::mt19937_64 rng(seed);
  std::discrete_distribution<int32_t> pick(pop.begin(), pop.end());
  std::vector<int64_t> taken_by_token(n, -1);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int32_t e = 0;
      if (!(first_is_expert0 && j == 0)) {
        do e = pick(rng);
        while (taken_by_token[e] == t);
      }
      taken_by_token[e] = t;
      ids[t * k + j] = e;
    }
  }
  return ids;
}
uint64_t stream_seed(const RoutingSpec& spec, uint64_t stream) { return spec.seed * 1000003ULL + stream * 7919ULL + 1; }
}  // namespace

std::vector<int32_t> sample_topk_ids(const RoutingSpec& spec, int64_t tokens, int64_t k, int64_t n, uint64_t stream) {
  return draw_topk(expert_popularity(spec, n), spec.kind == RoutingKind::one_expert, tokens, k,
                   stream_seed(spec, stream));
}

std::vector<double> rank_expert_popularity(const RoutingSpec& spec, int64_t n, int rank, int world) {
  require(world > 0 && n % world == 0, ErrorCode::invalid_argument, "num_experts must divide over the ranks");
  require(spec.locality >= 0 && spec.locality <= 1, ErrorCode::invalid_argument, "locality must be in [0, 1]");
  std::vector<double> p = expert_popularity(spec, n);
  if (spec.locality == 0) return p;
  const int64_t per_rank = n / world, first = rank * per_rank;
  const double local_mass = std::accumulate(p.begin() + first, p.begin() + first + per_rank, 0.0);
  for (int64_t e = 0; e < n; ++e) {
    const bool local = e >= first && e < first + per_rank;
    const double local_share = local ? (local_mass > 0 ? p[e] / local_mass : 1.0 / per_rank) : 0.0;
    p[e] = (1 - spec.locality) * p[e] + spec.locality * local_share;
  }
  return p;
}

std::vector<int32_t> sample_rank_topk_ids(const RoutingSpec& spec, int64_t tokens, int64_t k, int64_t n, int rank,
                                          int world) {
  return draw_topk(rank_expert_popularity(spec, n, rank, world), spec.kind == RoutingKind::one_expert, tokens, k,
                   stream_seed(spec, static_cast<uint64_t>(rank)));
}

}  // namespace moka::core
