// ProcessGroup over a DeviceGroup: host bytes staged through device memory and NCCL. Every
// call synchronizes; meant for small control data, not for rows.
#include <cuda_runtime.h>

#include <vector>

#include "comm/cuda_check.hpp"
#include "cuda/common/device_memory.hpp"
#include "moka/device_group.hpp"

namespace moka {
namespace {

class DeviceStagedGroup final : public ProcessGroup {
 public:
  explicit DeviceStagedGroup(DeviceGroup& g) : g_(g) {}
  int rank() const override { return g_.rank(); }
  int size() const override { return g_.size(); }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    char* dev = reserve(bytes * (g_.size() + 1));
    MOKA_CUDA_CHECK(cudaMemcpy(dev + bytes * g_.size(), send, bytes, cudaMemcpyHostToDevice));
    g_.all_gather(dev + bytes * g_.size(), dev, bytes, nullptr);
    MOKA_CUDA_CHECK(cudaMemcpy(recv, dev, bytes * g_.size(), cudaMemcpyDeviceToHost));
  }

  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override {
    size_t send_total = 0, recv_total = 0;
    for (int p = 0; p < g_.size(); ++p) {
      send_total = std::max(send_total, send_offsets[p] + send_bytes[p]);
      recv_total = std::max(recv_total, recv_offsets[p] + recv_bytes[p]);
    }
    char* dev = reserve(send_total + recv_total);
    MOKA_CUDA_CHECK(cudaMemcpy(dev, send, send_total, cudaMemcpyHostToDevice));
    g_.all_to_all_v(dev, send_bytes, send_offsets, dev + send_total, recv_bytes, recv_offsets, nullptr);
    MOKA_CUDA_CHECK(cudaMemcpy(recv, dev + send_total, recv_total, cudaMemcpyDeviceToHost));
  }

  void barrier() override {
    const char token = 1;
    std::vector<char> all(g_.size());
    all_gather(&token, all.data(), 1);
  }

  // NCCL has no in-band abort message: a failing rank's peers see the communicator error or
  // the launcher stops them.
  void abort(const std::string&) override {}

 private:
  char* reserve(size_t bytes) {
    if (bytes > staging_.size()) {
      staging_ = {};  // freed before the larger one is allocated
      staging_ = cuda::DeviceArray<char>(bytes);
    }
    return staging_.data();
  }

  DeviceGroup& g_;
  cuda::DeviceArray<char> staging_;
};

}  // namespace

std::unique_ptr<ProcessGroup> host_collectives(DeviceGroup& group) {
  return std::make_unique<DeviceStagedGroup>(group);
}

}  // namespace moka
