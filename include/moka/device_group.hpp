// GPU-side communication of an expert-parallel group: NCCL for collectives, symmetric buffers
// that every GPU of the group can load from and store to over NVLink, and a bounded device
// barrier. CUDA types appear as void* so this header needs no CUDA headers.
#pragma once
#include <cstddef>
#include <memory>
#include <vector>

#include "moka/process_group.hpp"

namespace moka {

// A buffer of equal size on every rank. `peers[r]` is rank r's buffer as this GPU addresses it
// (peers[rank] == local); `peers_device` is the same table in device memory, for kernels.
struct SymmetricBuffer {
  void* local = nullptr;
  std::vector<void*> peers;
  void** peers_device = nullptr;
  size_t bytes = 0;
};

class DeviceGroup {
 public:
  virtual ~DeviceGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int device() const = 0;
  virtual void* nccl_comm() const = 0;  // ncclComm_t

  // One grouped batch of point-to-point transfers on `stream` (ncclGroupStart/End): sends and
  // receives between a pair of ranks match in the order they are listed on each side.
  struct Transfer {
    int peer = 0;
    void* data = nullptr;  // read for a send, written for a receive
    size_t bytes = 0;
  };
  virtual void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream) = 0;
  // The all-to-all-v of byte ranges: one send and one receive per peer, through send_recv.
  virtual void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                            const size_t* recv_bytes, const size_t* recv_offsets, void* stream) = 0;
  virtual void all_gather(const void* send, void* recv, size_t bytes, void* stream) = 0;

  // Collective: every rank allocates `bytes` and maps every peer's buffer (CUDA IPC; the
  // handles travel through an NCCL all-gather). Owned by the group.
  virtual const SymmetricBuffer& allocate_symmetric(size_t bytes) = 0;

  // Enqueues a barrier among the group's GPUs on `stream`: each GPU signals every peer with a
  // system-scope release store and waits for all peers with acquire loads, at most
  // `timeout_seconds`; a peer that never arrives sets an error that check_device_errors()
  // reports naming that rank. Capturable in a CUDA graph (the epoch lives on the device).
  virtual void device_barrier(void* stream, double timeout_seconds) = 0;
  // Synchronizes nothing; reads the error word after the caller has synchronized the stream.
  virtual void check_device_errors() = 0;
  // Device address of that error word (a uint64: 0 while every barrier arrived, else 1 + the
  // rank that did not; it stays set): kernels after a barrier read it, stream-ordered, before
  // they read peer memory the barrier was meant to freeze.
  virtual const void* device_barrier_error() const = 0;
};

// Host-memory collectives carried by the device communicator (each call stages through device
// memory and synchronizes): the small control exchanges (validation, routing, counts) of a layer
// that was given only a DeviceGroup, e.g. one wrapping PyTorch's communicator.
std::unique_ptr<ProcessGroup> host_collectives(DeviceGroup& group);

// Creates a communicator for this rank on `device`: rank 0's NCCL unique id travels through
// `host` (e.g. the TCP group from rendezvous_from_env()).
std::unique_ptr<DeviceGroup> make_nccl_group(ProcessGroup& host, int device);
// Wraps a communicator the caller already has (PyTorch's, an MPI job's); not destroyed by moka.
std::unique_ptr<DeviceGroup> wrap_nccl_comm(void* nccl_comm, int device);

struct MoeShape;
struct LayerOptions;
class MoeLayer;
// The CUDA layer with its experts split over `group` (which must outlive it; null: one GPU), on
// the path LayerOptions::path picks. make_moe_layer(shape, Backend::cuda, host_group) builds the
// same over a new communicator.
std::unique_ptr<MoeLayer> make_moe_layer(const MoeShape& shape, DeviceGroup* group, const LayerOptions& options);

}  // namespace moka
