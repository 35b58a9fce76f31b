// DeviceGroup on NCCL: collectives through the communicator, symmetric buffers through CUDA IPC.
// Why CUDA IPC rather than NCCL 2.28 symmetric windows: it works with any communicator a user
// passes in (PyTorch's included) and any NCCL 2.x, and kernels see plain peer pointers either
// way; windows (ncclMemAlloc + ncclCommWindowRegister + LSA pointers) are the route to NVL72 and
// multi-node, behind the same SymmetricBuffer interface.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <deque>

#include "comm/cuda_check.hpp"
#include "comm/device_barrier.cuh"
#include "cuda/common/device_memory.hpp"
#include "moka/device_group.hpp"

namespace moka {
namespace {

class NcclGroup final : public DeviceGroup {
 public:
  NcclGroup(ncclComm_t comm, int device, bool owned) : comm_(comm), device_(device), owned_(owned) {
    MOKA_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    MOKA_NCCL_CHECK(ncclCommCount(comm_, &size_));
    MOKA_CUDA_CHECK(cudaSetDevice(device_));
    barrier_ = &allocate_symmetric(comm::barrier_region_words(size_) * sizeof(uint64_t));
  }

  ~NcclGroup() override {
    cudaSetDevice(device_);
    buffers_.clear();  // unmapped and freed on this group's device, before the communicator goes
    if (owned_) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return device_; }
  void* nccl_comm() const override { return comm_; }

  void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream) override {
    auto s = static_cast<cudaStream_t>(stream);
    MOKA_NCCL_CHECK(ncclGroupStart());
    for (const Transfer& t : sends)
      if (t.bytes) MOKA_NCCL_CHECK(ncclSend(t.data, t.bytes, ncclUint8, t.peer, comm_, s));
    for (const Transfer& t : recvs)
      if (t.bytes) MOKA_NCCL_CHECK(ncclRecv(t.data, t.bytes, ncclUint8, t.peer, comm_, s));
    MOKA_NCCL_CHECK(ncclGroupEnd());
  }

  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets, void* stream) override {
    std::vector<Transfer> sends(size_), recvs(size_);
    for (int p = 0; p < size_; ++p) {
      sends[p] = {p, const_cast<char*>(static_cast<const char*>(send)) + send_offsets[p], send_bytes[p]};
      recvs[p] = {p, static_cast<char*>(recv) + recv_offsets[p], recv_bytes[p]};
    }
    send_recv(sends, recvs, stream);
  }

  void all_gather(const void* send, void* recv, size_t bytes, void* stream) override {
    MOKA_NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, comm_, static_cast<cudaStream_t>(stream)));
  }

  const SymmetricBuffer& allocate_symmetric(size_t bytes) override {
    MOKA_CUDA_CHECK(cudaSetDevice(device_));
    OwnedSymmetric& o = buffers_.emplace_back();
    try {
      o.local = cuda::DeviceArray<std::byte>(bytes);
      MOKA_CUDA_CHECK(cudaMemset(o.local.data(), 0, bytes));
      cudaIpcMemHandle_t mine;
      MOKA_CUDA_CHECK(cudaIpcGetMemHandle(&mine, o.local.data()));
      const std::vector<cudaIpcMemHandle_t> all = gather_handles(mine);
      o.view.bytes = bytes;
      o.view.local = o.local.data();
      o.view.peers.assign(size_, nullptr);
      o.mappings.resize(size_);
      for (int r = 0; r < size_; ++r) {
        if (r != rank_) o.mappings[r] = cuda::IpcMapping(all[r]);
        o.view.peers[r] = r == rank_ ? o.view.local : o.mappings[r].data();
      }
      o.peers_device = cuda::DeviceArray<void*>(size_);
      o.peers_device.upload(o.view.peers, cudaStreamLegacy);
      o.view.peers_device = o.peers_device.data();
    } catch (...) {
      buffers_.pop_back();
      throw;
    }
    return o.view;
  }

  void device_barrier(void* stream, double timeout_seconds) override {
    comm::BarrierView v{reinterpret_cast<uint64_t**>(barrier_->peers_device), rank_, size_,
                        static_cast<uint64_t>(timeout_seconds * 1e9)};
    comm::launch_device_barrier(v, stream);
  }

  void check_device_errors() override {
    uint64_t error = 0;
    MOKA_CUDA_CHECK(cudaMemcpy(&error, device_barrier_error(), sizeof(error), cudaMemcpyDeviceToHost));
    if (error != 0) {
      throw Error(ErrorCode::timeout, "device barrier on rank " + std::to_string(rank_) + ": rank " +
                                          std::to_string(error - 1) + " did not arrive in time");
    }
  }

  const void* device_barrier_error() const override {
    return static_cast<const uint64_t*>(barrier_->local) + comm::barrier_error_word(size_);
  }

 private:
  // IPC handles travel through an NCCL all-gather, so no host channel is needed.
  std::vector<cudaIpcMemHandle_t> gather_handles(const cudaIpcMemHandle_t& mine) {
    const size_t h = sizeof(cudaIpcMemHandle_t);
    cuda::DeviceArray<cudaIpcMemHandle_t> dev(size_ + 1);
    MOKA_CUDA_CHECK(cudaMemcpy(dev.data() + size_, &mine, h, cudaMemcpyHostToDevice));
    all_gather(dev.data() + size_, dev.data(), h, nullptr);
    std::vector<cudaIpcMemHandle_t> all(size_);
    MOKA_CUDA_CHECK(cudaMemcpy(all.data(), dev.data(), h * size_, cudaMemcpyDeviceToHost));  // syncs the gather
    return all;
  }

  ncclComm_t comm_;
  int device_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  // A symmetric buffer with what backs it (the view's pointers point into these).
  struct OwnedSymmetric {
    cuda::DeviceArray<std::byte> local;
    std::vector<cuda::IpcMapping> mappings;  // [rank]; this rank's entry is empty
    cuda::DeviceArray<void*> peers_device;
    SymmetricBuffer view;
  };
  std::deque<OwnedSymmetric> buffers_;  // deque: references stay valid as buffers are added
  const SymmetricBuffer* barrier_ = nullptr;
};

}  // namespace

std::unique_ptr<DeviceGroup> make_nccl_group(ProcessGroup& host, int device) {
  MOKA_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  if (host.rank() == 0) MOKA_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<ncclUniqueId> ids(host.size());
  host.all_gather(&id, ids.data(), sizeof(id));
  ncclComm_t comm;
  MOKA_NCCL_CHECK(ncclCommInitRank(&comm, host.size(), ids[0], host.rank()));
  return std::make_unique<NcclGroup>(comm, device, true);
}

std::unique_ptr<DeviceGroup> wrap_nccl_comm(void* nccl_comm, int device) {
  require(nccl_comm != nullptr, ErrorCode::invalid_argument, "wrap_nccl_comm: null communicator");
  return std::make_unique<NcclGroup>(static_cast<ncclComm_t>(nccl_comm), device, false);
}

}  // namespace moka
