// moka's default stream-ordered pool (device_memory.hpp): one CUDA memory pool per device,
// created on first use and kept for the process's life (layers and contexts may outlive any
// owner we could give it). Its release threshold is unbounded: memory a call gave back stays
// reserved for the next call instead of going back to the driver at each synchronization.
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "cuda/common/device_memory.hpp"

namespace moka::cuda {
namespace {

class PoolAllocator final : public DeviceAllocator {
 public:
  explicit PoolAllocator(int device) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    MOKA_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
    uint64_t keep_all = UINT64_MAX;
    MOKA_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all));
  }
  void* allocate(size_t bytes, Stream stream) override {
    void* p = nullptr;
    const cudaError_t e = cudaMallocFromPoolAsync(&p, bytes, pool_, static_cast<cudaStream_t>(stream.handle));
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw Error(ErrorCode::cuda, "out of device memory: moka's pool could not allocate " + std::to_string(bytes) +
                                       " bytes for a layer call");
    }
    MOKA_CUDA_CHECK(e);
    return p;
  }
  void deallocate(void* pointer, size_t, Stream stream) override {
    // A destructor's path: a failure here (a context destroyed after the device failed) has no
    // caller to report to, and the device's error surfaces at the next checked call.
    if (cudaFreeAsync(pointer, static_cast<cudaStream_t>(stream.handle)) != cudaSuccess) cudaGetLastError();
  }

 private:
  cudaMemPool_t pool_ = nullptr;
};

}  // namespace

DeviceAllocator& default_device_allocator() {
  static std::mutex mutex;
  static auto* pools = new std::unordered_map<int, PoolAllocator*>();  // never destroyed: see above
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  PoolAllocator*& pool = (*pools)[device];
  if (!pool) pool = new PoolAllocator(device);
  return *pool;
}

}  // namespace moka::cuda
