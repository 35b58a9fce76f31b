// The collective interface a layer uses to talk to its expert-parallel peers. Backends:
// an in-process thread group (CPU emulation of N ranks), and later NCCL communicators.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace moka {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank contributes `bytes` bytes; `recv` receives size()*bytes in rank order.
  virtual void all_gather(const void* send, void* recv, size_t bytes) = 0;
  // Rank r sends send_bytes[p] bytes starting at send + send_offsets[p] to every peer p and
  // receives recv_bytes[p] bytes from p at recv + recv_offsets[p] (all in bytes).
  virtual void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                            const size_t* recv_bytes, const size_t* recv_offsets) = 0;
  virtual void barrier() = 0;
  // Marks this rank failed so that peers waiting in a collective stop with peer_failure
  // instead of hanging. Called by run_emulated_ranks when a rank's body throws.
  virtual void abort(const std::string& reason) = 0;
};

struct EmulationOptions {
  double timeout_seconds = 120.0;  // a collective that waits longer reports a timeout
};

// Runs `body` on `world_size` threads, each with its own rank of one in-process group.
// Rethrows the first rank's error (by rank order) after every thread has stopped; a rank that
// throws aborts the group, so its peers stop with peer_failure rather than hang.
void run_emulated_ranks(int world_size, const std::function<void(ProcessGroup&)>& body,
                        const EmulationOptions& options = {});

}  // namespace moka
