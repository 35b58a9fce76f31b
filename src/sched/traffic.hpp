// Traffic matrices of one MoE all-to-all epoch, the fabric they cross, and the lower bound T*.
// Plain C++ (no CUDA): every rank can build the same matrix from the routing it already knows.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/routing_gen.hpp"

namespace moka::sched {

// Port bandwidths in bytes per second. Single tier (gpus_per_server == 0): every GPU hangs off
// one non-blocking switch (an NVSwitch domain) with one egress and one ingress port. Two tier:
// servers of gpus_per_server GPUs on NVLink, and one NIC per GPU (rail) into a non-blocking
// inter-server network.
struct Fabric {
  int gpus = 8;
  double link_bw = 450e9;       // per GPU and direction, when the per-port lists are empty
  std::vector<double> send_bw;  // optional per-GPU egress bandwidth
  std::vector<double> recv_bw;  // optional per-GPU ingress bandwidth
  int gpus_per_server = 0;      // 0: single tier
  double nic_bw = 50e9;         // per GPU NIC and direction (two tier)

  double send_bw_of(int gpu) const { return send_bw.empty() ? link_bw : send_bw.at(gpu); }
  double recv_bw_of(int gpu) const { return recv_bw.empty() ? link_bw : recv_bw.at(gpu); }
  bool two_tier() const { return gpus_per_server > 0; }
  int servers() const { return two_tier() ? gpus / gpus_per_server : 1; }
  int server_of(int gpu) const { return two_tier() ? gpu / gpus_per_server : 0; }
  void validate() const;
};

// Bytes from GPU i (row) to GPU j (column); the diagonal is local and always zero.
struct TrafficMatrix {
  int n = 0;
  std::vector<int64_t> bytes;  // row-major n x n

  TrafficMatrix() = default;
  explicit TrafficMatrix(int gpus) : n(gpus), bytes(static_cast<size_t>(gpus) * gpus, 0) {}
  int64_t& at(int i, int j) { return bytes[static_cast<size_t>(i) * n + j]; }
  int64_t at(int i, int j) const { return bytes[static_cast<size_t>(i) * n + j]; }
  int64_t row_sum(int i) const;
  int64_t col_sum(int j) const;
  int64_t total() const;
  int64_t max_line_sum() const;  // max over rows and columns
  bool operator==(const TrafficMatrix&) const = default;
};

// How routes become bytes: per_route counts every (token, expert) pair (an expert-major
// dispatch that sends a row once per selected expert); per_gpu deduplicates, sending a token
// once to each GPU that hosts at least one of its experts (the receiver fans it out locally).
enum class CountMode : uint8_t { per_route, per_gpu };
CountMode parse_count_mode(const std::string& name);  // "route" | "gpu"

// Matrix of one dispatch: topk_ids[r] holds rank r's [tokens * top_k] expert ids; experts are
// laid out contiguously, num_experts / world per rank.
TrafficMatrix traffic_from_routing(const std::vector<std::vector<int32_t>>& topk_ids, int top_k, int num_experts,
                                   int64_t bytes_per_row, CountMode mode);

// Most ranks (GPUs) a simulated epoch may hold, synthetic (`moka simulate --gpus`) or replayed
// from a routing dump: one cap for both, so that a dump cannot declare a fabric (and ranks^2
// matrices) that the command line refuses.
constexpr int kMaxRanks = 4096;

// Synthetic routing (uniform, Zipf at a target Gini, per-rank locality) turned into a matrix.
struct SyntheticTraffic {
  int gpus = 64;
  int64_t tokens_per_rank = 4096;
  int top_k = 8;
  int experts_per_gpu = 4;
  int64_t bytes_per_row = 7168 * 2;  // hidden 7168 in bf16
  core::RoutingSpec routing{core::RoutingKind::zipf, 0.3, 1, 0.0};
  CountMode mode = CountMode::per_route;
};
TrafficMatrix synthetic_traffic(const SyntheticTraffic& spec);

// Gini of the per-receiver byte totals (the skew the fabric sees).
double receiver_gini(const TrafficMatrix& d);

// T* = max(max_i rowsum_i / send_bw_i, max_j colsum_j / recv_bw_j): no schedule on a
// non-blocking single-tier fabric finishes sooner. `port` is the GPU whose port binds.
struct LowerBound {
  double seconds = 0;
  int port = 0;
  bool receiver = true;  // the binding port is an ingress port
};
LowerBound lower_bound(const TrafficMatrix& d, const Fabric& fabric);
// The receiver with the largest colsum / recv_bw: the incast hot spot.
int hottest_receiver(const TrafficMatrix& d, const Fabric& fabric);

}  // namespace moka::sched
