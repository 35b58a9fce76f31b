#include "comm/cuda_check.hpp"
#include "comm/device_barrier.cuh"

namespace moka::comm {
namespace {

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread p signals peer p, then waits for peer p's signal.
__global__ void device_barrier_kernel(BarrierView v) {
  __shared__ uint64_t epoch;
  uint64_t* own = v.peer_regions[v.rank];
  if (threadIdx.x == 0) epoch = own[v.world] + 1;
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < v.world) {
    // Every write this GPU made before the barrier becomes visible to the peer first.
    store_release_sys(v.peer_regions[peer] + v.rank, epoch);
    const uint64_t start = global_time_ns();
    while (load_acquire_sys(own + peer) < epoch) {
      if (global_time_ns() - start > v.timeout_ns) {
        atomicCAS(reinterpret_cast<unsigned long long*>(own + barrier_error_word(v.world)), 0ull,
                  static_cast<unsigned long long>(peer + 1));
        break;
      }
      __nanosleep(256);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) own[v.world] = epoch;
}

}  // namespace

void launch_device_barrier(const BarrierView& view, void* stream) {
  device_barrier_kernel<<<1, view.world, 0, static_cast<cudaStream_t>(stream)>>>(view);
  MOKA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moka::comm
