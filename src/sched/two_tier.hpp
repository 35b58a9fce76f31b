// Two-tier schedule (servers of GPUs on NVLink, one NIC per GPU into a non-blocking network),
// after FAST/FLASH: balance inside each server over NVLink so that GPU g of server a holds
// 1/G of what a sends to every other server, run Birkhoff-von Neumann phases on the server
// matrix with rail-aligned transfers (GPU g of a to GPU g of b), and forward each phase's
// bytes over NVLink to their final GPU during the next phase. Fluid cost model:
//   balance + sum_k max(inter_k, forward_{k-1}) + last forward (+ one barrier per phase),
// where intra-server pairs travel over NVLink during the balance step.
#pragma once
#include "sched/policies.hpp"

namespace moka::sched {

struct TwoTierResult {
  double server_bound_s = 0;      // max over servers of inter-server bytes / (G * nic_bw)
  double direct_nic_bound_s = 0;  // the same per GPU NIC without forwarding (no balancing)
  double completion_s = 0;
  double balance_s = 0;
  double last_forward_s = 0;
  int phases = 0;
};

TwoTierResult plan_two_tier(const TrafficMatrix& d, const Fabric& fabric, const PolicyOptions& options = {});

// Bytes between servers (diagonal zero).
TrafficMatrix server_matrix(const TrafficMatrix& d, const Fabric& fabric);

}  // namespace moka::sched
