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

std::vector<int32_t> sample_topk_ids(const RoutingSpec& spec, int64_t tokens, int64_t k,
                                     int64_t n, uint64_t stream) {
  require(k <= n, ErrorCode::invalid_argument, "top_k exceeds the number of experts");
  std::vector<int32_t> ids(tokens * k);
  std::mt19937_64 rng(spec.seed * 1000003ULL + stream * 7919ULL + 1);
  const std::vector<double> pop = expert_popularity(spec, n);
  std::vector<double> w(n);
  for (int64_t t = 0; t < tokens; ++t) {
    w = pop;
    for (int64_t j = 0; j < k; ++j) {
      int64_t e;
      if (spec.kind == RoutingKind::one_expert && j == 0) {
        e = 0;
      } else {
        // Sequential sampling without replacement (Gumbel-free; cheap for the sizes we use).
        const double total = std::accumulate(w.begin(), w.end(), 0.0);
        double u = std::uniform_real_distribution<double>(0.0, total)(rng);
        e = 0;
        while (e < n - 1 && (w[e] == 0 || u >= w[e])) {
          u -= w[e];
          ++e;
        }
        while (w[e] == 0) e = (e + n - 1) % n;  // rounding at the tail
      }
      ids[t * k + j] = static_cast<int32_t>(e);
      w[e] = 0;
    }
  }
  return ids;
}

}  // namespace moka::core
