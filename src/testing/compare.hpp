// Error measures used to check a result against a reference.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace moka::cpu {

// max_i |a_i - ref_i| / max_i |ref_i|; NaN anywhere in `a` gives +inf so it can never pass.
template <typename A, typename R>
double max_rel_error(const A* a, const R* ref, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double av = static_cast<double>(a[i]), rv = static_cast<double>(ref[i]);
    if (!std::isfinite(av)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(av - rv));
    scale = std::max(scale, std::abs(rv));
  }
  return scale > 0 ? diff / scale : diff;
}

template <typename A, typename R>
double max_rel_error(const std::vector<A>& a, const std::vector<R>& ref) {
  return max_rel_error(a.data(), ref.data(), static_cast<int64_t>(std::min(a.size(), ref.size())));
}

}  // namespace moka::cpu
