#include "sched/traffic.hpp"

#include <algorithm>

#include "moka/error.hpp"

namespace moka::sched {

void Fabric::validate() const {
  require(gpus >= 2, ErrorCode::invalid_argument, "the fabric needs at least 2 GPUs");
  require(send_bw.empty() || static_cast<int>(send_bw.size()) == gpus, ErrorCode::shape_mismatch,
          "send_bw needs one entry per GPU");
  require(recv_bw.empty() || static_cast<int>(recv_bw.size()) == gpus, ErrorCode::shape_mismatch,
          "recv_bw needs one entry per GPU");
  for (int g = 0; g < gpus; ++g)
    require(send_bw_of(g) > 0 && recv_bw_of(g) > 0, ErrorCode::invalid_argument, "bandwidths must be positive");
  require(!two_tier() || (gpus % gpus_per_server == 0 && nic_bw > 0), ErrorCode::invalid_argument,
          "gpus must be a multiple of gpus_per_server and nic_bw positive");
}

int64_t TrafficMatrix::row_sum(int i) const {
  int64_t s = 0;
  for (int j = 0; j < n; ++j) s += at(i, j);
  return s;
}

int64_t TrafficMatrix::col_sum(int j) const {
  int64_t s = 0;
  for (int i = 0; i < n; ++i) s += at(i, j);
  return s;
}

int64_t TrafficMatrix::total() const {
  int64_t s = 0;
  for (int64_t b : bytes) s += b;
  return s;
}

int64_t TrafficMatrix::max_line_sum() const {
  int64_t m = 0;
  for (int k = 0; k < n; ++k) m = std::max({m, row_sum(k), col_sum(k)});
  return m;
}

CountMode parse_count_mode(const std::string& name) {
  if (name == "route") return CountMode::per_route;
  if (name == "gpu") return CountMode::per_gpu;
  throw Error(ErrorCode::invalid_argument, "unknown count mode '" + name + "' (route, gpu)");
}

TrafficMatrix traffic_from_routing(const std::vector<std::vector<int32_t>>& topk_ids, int top_k, int num_experts,
                                   int64_t bytes_per_row, CountMode mode) {
  const int world = static_cast<int>(topk_ids.size());
  require(top_k >= 1, ErrorCode::invalid_argument, "top_k must be >= 1, got " + std::to_string(top_k));
  require(world >= 2 && num_experts % world == 0, ErrorCode::invalid_argument,
          "need >= 2 ranks and num_experts divisible by the ranks");
  const int experts_per_rank = num_experts / world;
  TrafficMatrix d(world);
  std::vector<int64_t> last_token_at(world);
  for (int src = 0; src < world; ++src) {
    const auto& ids = topk_ids[src];
    require(ids.size() % top_k == 0, ErrorCode::shape_mismatch,
            "rank " + std::to_string(src) + "'s topk_ids (" + std::to_string(ids.size()) +
                " ids) is not tokens x top_k " + std::to_string(top_k));
    std::fill(last_token_at.begin(), last_token_at.end(), -1);
    for (size_t r = 0; r < ids.size(); ++r) {
      require(ids[r] >= 0 && ids[r] < num_experts, ErrorCode::expert_out_of_range,
              "rank " + std::to_string(src) + ": expert id " + std::to_string(ids[r]) + " outside [0, " +
                  std::to_string(num_experts) + ")");
      const int dst = ids[r] / experts_per_rank;
      const auto token = static_cast<int64_t>(r / top_k);
      if (mode == CountMode::per_gpu && last_token_at[dst] == token) continue;
      last_token_at[dst] = token;
      if (dst != src) d.at(src, dst) += bytes_per_row;
    }
  }
  return d;
}

TrafficMatrix synthetic_traffic(const SyntheticTraffic& s) {
  require(s.tokens_per_rank >= 1 && s.top_k >= 1 && s.experts_per_gpu >= 1 && s.bytes_per_row >= 1,
          ErrorCode::invalid_argument,
          "synthetic traffic needs tokens_per_rank, top_k, experts_per_gpu and bytes_per_row >= 1");
  const int experts = s.gpus * s.experts_per_gpu;
  std::vector<std::vector<int32_t>> ids(s.gpus);
  for (int r = 0; r < s.gpus; ++r)
    ids[r] = core::sample_rank_topk_ids(s.routing, s.tokens_per_rank, s.top_k, experts, r, s.gpus);
  return traffic_from_routing(ids, s.top_k, experts, s.bytes_per_row, s.mode);
}

double receiver_gini(const TrafficMatrix& d) {
  std::vector<double> cols(d.n);
  for (int j = 0; j < d.n; ++j) cols[j] = static_cast<double>(d.col_sum(j));
  return core::gini(cols);
}

LowerBound lower_bound(const TrafficMatrix& d, const Fabric& f) {
  LowerBound lb;
  for (int k = 0; k < d.n; ++k) {
    const double send = static_cast<double>(d.row_sum(k)) / f.send_bw_of(k);
    const double recv = static_cast<double>(d.col_sum(k)) / f.recv_bw_of(k);
    if (send > lb.seconds) lb = {send, k, false};
    if (recv > lb.seconds) lb = {recv, k, true};
  }
  return lb;
}

int hottest_receiver(const TrafficMatrix& d, const Fabric& f) {
  int hot = 0;
  double worst = -1;
  for (int j = 0; j < d.n; ++j) {
    const double t = static_cast<double>(d.col_sum(j)) / f.recv_bw_of(j);
    if (t > worst) worst = t, hot = j;
  }
  return hot;
}

}  // namespace moka::sched
