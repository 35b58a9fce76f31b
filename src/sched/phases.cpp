#include "sched/phases.hpp"

#include <algorithm>
#include <tuple>

#include "moka/error.hpp"

namespace moka::sched {

TrafficMatrix pad_to_equal_line_sums(const TrafficMatrix& d) {
  TrafficMatrix p = d;
  const int64_t line = d.max_line_sum();
  std::vector<int64_t> row_gap(d.n), col_gap(d.n);
  for (int k = 0; k < d.n; ++k) row_gap[k] = line - d.row_sum(k), col_gap[k] = line - d.col_sum(k);
  for (int i = 0, j = 0; i < d.n && j < d.n;) {
    const int64_t add = std::min(row_gap[i], col_gap[j]);
    p.at(i, j) += add;
    row_gap[i] -= add, col_gap[j] -= add;
    if (row_gap[i] == 0) ++i;
    if (j < d.n && col_gap[j] == 0) ++j;
  }
  return p;
}

namespace {

// A perfect matching on the positive entries of a matrix with equal line sums (one exists by
// Birkhoff's theorem), kept across phases and repaired by augmenting paths (Kuhn).
class PerfectMatching {
 public:
  explicit PerfectMatching(const TrafficMatrix& m)
      : m_(m), adj_(m.n), col_owner_(m.n, -1), row_match_(m.n, -1), seen_(m.n, 0) {
    for (int i = 0; i < m.n; ++i)
      for (int j = 0; j < m.n; ++j)
        if (m.at(i, j) > 0) adj_[i].push_back(j);
  }

  // Matches every unmatched row; false if the positive entries admit no perfect matching.
  bool complete() {
    for (int i = 0; i < m_.n; ++i)
      if (row_match_[i] < 0 && !(++stamp_, augment(i))) return false;
    return true;
  }
  int receiver_of(int i) const { return row_match_[i]; }
  // Entry (i, j) reached zero: drop it from the graph and the matching.
  void remove(int i, int j) {
    std::erase(adj_[i], j);
    if (row_match_[i] == j) row_match_[i] = -1, col_owner_[j] = -1;
  }

 private:
  bool augment(int i) {
    for (int j : adj_[i]) {
      if (seen_[j] == stamp_) continue;
      seen_[j] = stamp_;
      if (col_owner_[j] < 0 || augment(col_owner_[j])) {
        row_match_[i] = j, col_owner_[j] = i;
        return true;
      }
    }
    return false;
  }

  const TrafficMatrix& m_;
  std::vector<std::vector<int>> adj_;
  std::vector<int> col_owner_, row_match_;
  std::vector<int64_t> seen_;
  int64_t stamp_ = 0;
};

// Takes `weight` from every matched pair of `left`, real bytes (from `real`) first.
Phase take_phase(const std::vector<int>& receiver_of, int64_t weight, TrafficMatrix& left, TrafficMatrix& real) {
  Phase ph{receiver_of, std::vector<int64_t>(receiver_of.size(), 0), weight};
  for (int i = 0; i < left.n; ++i) {
    const int j = receiver_of[i];
    if (j < 0) continue;
    ph.bytes_of[i] = std::min(weight, real.at(i, j));
    real.at(i, j) -= ph.bytes_of[i];
    left.at(i, j) -= weight;
  }
  return ph;
}

bool carries_data(const Phase& ph) {
  return std::any_of(ph.bytes_of.begin(), ph.bytes_of.end(), [](int64_t b) { return b > 0; });
}

}  // namespace

std::vector<Phase> bvn_phases(const TrafficMatrix& d) {
  TrafficMatrix left = pad_to_equal_line_sums(d), real = d;
  PerfectMatching matching(left);
  std::vector<Phase> phases;
  for (int64_t remaining = left.max_line_sum(); remaining > 0;) {
    require(matching.complete(), ErrorCode::internal, "BvN: no perfect matching on a balanced matrix");
    std::vector<int> receiver_of(d.n);
    int64_t weight = remaining;
    for (int i = 0; i < d.n; ++i)
      receiver_of[i] = matching.receiver_of(i), weight = std::min(weight, left.at(i, receiver_of[i]));
    Phase ph = take_phase(receiver_of, weight, left, real);
    for (int i = 0; i < d.n; ++i)
      if (left.at(i, receiver_of[i]) == 0) matching.remove(i, receiver_of[i]);
    remaining -= weight;
    if (carries_data(ph)) phases.push_back(std::move(ph));
  }
  return phases;
}

std::vector<Phase> greedy_phases(const TrafficMatrix& d, int budget, TrafficMatrix& residual) {
  residual = d;
  TrafficMatrix unused = d;  // greedy has no padding: real and left are the same bytes
  std::vector<Phase> phases;
  std::vector<std::tuple<int64_t, int, int, int>> entries;  // (-bytes, shift, i, j)
  for (int k = 0; k < budget; ++k) {
    entries.clear();
    for (int i = 0; i < d.n; ++i)
      for (int j = 0; j < d.n; ++j)
        if (residual.at(i, j) > 0) entries.emplace_back(-residual.at(i, j), (j - i + d.n) % d.n, i, j);
    if (entries.empty()) break;
    std::sort(entries.begin(), entries.end());
    std::vector<int> receiver_of(d.n, -1);
    std::vector<bool> receiver_busy(d.n, false);
    int64_t weight = -std::get<0>(entries.front());
    for (const auto& [neg_bytes, shift, i, j] : entries) {
      if (receiver_of[i] >= 0 || receiver_busy[j]) continue;
      receiver_of[i] = j, receiver_busy[j] = true;
      weight = std::min(weight, -neg_bytes);
    }
    phases.push_back(take_phase(receiver_of, weight, unused, residual));
  }
  return phases;
}

}  // namespace moka::sched
