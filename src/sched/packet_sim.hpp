// Chunk-level discrete-event model of a single-tier switch with finite output buffers.
//
// Fabric model: each GPU's egress link serialises one chunk at a time at its send bandwidth;
// a chunk reaches the switch one propagation delay after its last byte left (store and
// forward); each output port keeps a FIFO and serialises to its GPU at the receive bandwidth,
// the GPU getting the chunk one more propagation delay later. Buffers are per output port.
// Back-pressure, lossless in both modes:
//  - credit (NVLink-like): a sender needs credit for the whole chunk at the output port before
//    it starts (the buffer is never exceeded); credits come back one propagation delay after
//    the chunk leaves the port. A sender blocked on one port may pass that chunk by up to n
//    chunks of its order (virtual output queues), so the hot port does not block the rest.
//  - pfc: no credits; when a port holds >= buffer bytes it pauses (after one propagation
//    delay) every sender with a chunk in it until the port drains below half the buffer. A
//    paused sender sends nothing at all: head-of-line blocking, as PFC pauses whole links.
//    In-flight chunks still land, so the peak may exceed the buffer (the headroom).
// Policies: all but max_min_fair (a flow-level ideal with no chunk-level counterpart).
// Rate-based senders pace their virtual-finish-time order at rowsum / T*; phased policies open
// phase k+1 one barrier after every chunk of phase k has been delivered.
#pragma once
#include <cstdint>

#include "sched/fluid_sim.hpp"

namespace moka::sched {

enum class BackPressure : uint8_t { credit, pfc };
BackPressure parse_back_pressure(const std::string& name);  // "credit" | "pfc"

struct PacketOptions {
  int64_t chunk_bytes = 256 << 10;
  double buffer_bytes = 0;  // per output port; 0 = unbounded (no back-pressure)
  BackPressure mode = BackPressure::credit;
  double propagation_s = 0.5e-6;
  int series_points = 0;
};

SimResult simulate_packets(Policy p, const TrafficMatrix& d, const Fabric& fabric, const PolicyOptions& policy,
                           const PacketOptions& options);

}  // namespace moka::sched
