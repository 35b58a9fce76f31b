// A barrier among the GPUs of a group through symmetric memory, with explicit memory ordering
// (NCCL device API style): arrive = release store at system scope into every peer's slot for
// this rank; wait = acquire loads of this rank's slots until every peer's epoch has arrived.
// Bounded: past the deadline the waiting GPU records which peer is missing instead of hanging.
#pragma once
#include <cstdint>

#include "core/hd.hpp"

namespace moka::comm {

// Layout of the barrier's region of a symmetric buffer (uint64 words):
//   [0, world)   arrival slots, slot r written by rank r
//   world        this rank's epoch counter (device-side, so the barrier is graph-capturable)
//   world + 1    error word: 0 = fine, else 1 + the rank that did not arrive
struct BarrierView {
  uint64_t** peer_regions;  // [world] peer region pointers (peer_regions[rank] = own)
  int rank;
  int world;
  uint64_t timeout_ns;
};

MOKA_HD constexpr int barrier_region_words(int world) { return world + 2; }
MOKA_HD constexpr int barrier_error_word(int world) { return world + 1; }

// Launches the barrier kernel (one block of `world` threads) on `stream`.
void launch_device_barrier(const BarrierView& view, void* stream);

}  // namespace moka::comm
