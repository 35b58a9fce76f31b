#include "sched/two_tier.hpp"

#include <algorithm>

#include "moka/error.hpp"

namespace moka::sched {

TrafficMatrix server_matrix(const TrafficMatrix& d, const Fabric& f) {
  TrafficMatrix m(f.servers());
  for (int i = 0; i < d.n; ++i)
    for (int j = 0; j < d.n; ++j)
      if (f.server_of(i) != f.server_of(j)) m.at(f.server_of(i), f.server_of(j)) += d.at(i, j);
  return m;
}

namespace {

// NVLink bytes each GPU sends and receives in one step; the step lasts as long as its busiest port.
struct NvlinkStep {
  std::vector<double> out, in;
  explicit NvlinkStep(int gpus) : out(gpus, 0), in(gpus, 0) {}
  void move(int from, int to, double bytes) { out[from] += bytes, in[to] += bytes; }
  double seconds(const Fabric& f) const {
    double t = 0;
    for (size_t g = 0; g < out.size(); ++g)
      t = std::max({t, out[g] / f.send_bw_of(static_cast<int>(g)), in[g] / f.recv_bw_of(static_cast<int>(g))});
    return t;
  }
};

// Intra-server pairs, plus moving surplus so that every GPU of server a holds an equal share
// of a's bytes for each other server (surplus GPUs hand bytes to deficit GPUs, in index order).
NvlinkStep balance_step(const TrafficMatrix& d, const Fabric& f) {
  NvlinkStep step(d.n);
  const int per = f.gpus_per_server;
  for (int i = 0; i < d.n; ++i)
    for (int j = 0; j < d.n; ++j)
      if (i != j && f.server_of(i) == f.server_of(j)) step.move(i, j, static_cast<double>(d.at(i, j)));
  for (int a = 0; a < f.servers(); ++a)
    for (int b = 0; b < f.servers(); ++b) {
      if (a == b) continue;
      std::vector<double> surplus(per);
      double total = 0;
      for (int g = 0; g < per; ++g) {
        for (int j = b * per; j < (b + 1) * per; ++j) surplus[g] += static_cast<double>(d.at(a * per + g, j));
        total += surplus[g];
      }
      for (double& s : surplus) s -= total / per;
      for (int giver = 0, taker = 0; giver < per && taker < per;) {
        if (surplus[giver] <= 0) {
          ++giver;
          continue;
        }
        if (surplus[taker] >= 0) {
          ++taker;
          continue;
        }
        const double moved = std::min(surplus[giver], -surplus[taker]);
        step.move(a * per + giver, a * per + taker, moved);
        surplus[giver] -= moved, surplus[taker] += moved;
      }
    }
  return step;
}

// Forwarding of one server phase: rail g of server b received 1/G of the phase's bytes from
// server a and hands each local GPU its part (in proportion to what a sends that GPU).
NvlinkStep forward_step(const TrafficMatrix& d, const Fabric& f, const TrafficMatrix& servers, const Phase& ph) {
  NvlinkStep step(d.n);
  const int per = f.gpus_per_server;
  for (int a = 0; a < f.servers(); ++a) {
    const int b = ph.receiver_of[a];
    if (b < 0 || ph.bytes_of[a] == 0) continue;
    const double per_rail = static_cast<double>(ph.bytes_of[a]) / per;
    const double pair_total = static_cast<double>(servers.at(a, b));
    for (int j = b * per; j < (b + 1) * per; ++j) {
      double to_j = 0;
      for (int i = a * per; i < (a + 1) * per; ++i) to_j += static_cast<double>(d.at(i, j));
      for (int rail = b * per; rail < (b + 1) * per; ++rail)
        if (rail != j) step.move(rail, j, per_rail * to_j / pair_total);
    }
  }
  return step;
}

double server_bound(const TrafficMatrix& servers, const Fabric& f) {
  double bound = 0;
  for (int a = 0; a < servers.n; ++a)
    bound = std::max(bound, static_cast<double>(std::max(servers.row_sum(a), servers.col_sum(a))));
  return bound / (f.gpus_per_server * f.nic_bw);
}

double direct_nic_bound(const TrafficMatrix& d, const Fabric& f) {
  std::vector<double> out(d.n), in(d.n);
  for (int i = 0; i < d.n; ++i)
    for (int j = 0; j < d.n; ++j)
      if (f.server_of(i) != f.server_of(j))
        out[i] += static_cast<double>(d.at(i, j)), in[j] += static_cast<double>(d.at(i, j));
  return std::max(*std::max_element(out.begin(), out.end()), *std::max_element(in.begin(), in.end())) / f.nic_bw;
}

}  // namespace

TwoTierResult plan_two_tier(const TrafficMatrix& d, const Fabric& f, const PolicyOptions& o) {
  require(f.two_tier() && d.n == f.gpus, ErrorCode::invalid_argument,
          "two-tier planning needs gpus_per_server and a matching matrix");
  f.validate();
  const TrafficMatrix servers = server_matrix(d, f);
  TwoTierResult r;
  r.server_bound_s = server_bound(servers, f);
  r.direct_nic_bound_s = direct_nic_bound(d, f);
  r.balance_s = balance_step(d, f).seconds(f);
  const auto phases = servers.n > 1 ? bvn_phases(servers) : std::vector<Phase>{};
  r.phases = static_cast<int>(phases.size());
  double t = r.balance_s, previous_forward = 0;
  for (const Phase& ph : phases) {
    double inter = 0;
    for (int a = 0; a < servers.n; ++a)
      inter = std::max(inter, static_cast<double>(ph.bytes_of[a]) / (f.gpus_per_server * f.nic_bw));
    t += std::max(inter, previous_forward) + o.barrier_s;
    previous_forward = forward_step(d, f, servers, ph).seconds(f);
  }
  r.last_forward_s = previous_forward;
  r.completion_s = t + previous_forward;
  return r;
}

}  // namespace moka::sched
