// DeviceBuffer::fill_normal's kernel: each value from a counter-based hash of (seed, index), so
// a buffer's contents depend on its seed only, whatever the launch shape.
#include <cuda_bf16.h>

#include "gpu/cuda_check.hpp"
#include "gpu/device_tensors.hpp"

namespace moka::cli {
namespace {

__device__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Box-Muller on two 24-bit uniforms of one hash (u1 in (0, 1], so the log is finite).
__global__ void fill_normal_bf16(__nv_bfloat16* values, int64_t count, uint64_t seed, float stddev) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint64_t bits = splitmix64(seed ^ splitmix64(uint64_t(i)));
    const float u1 = float((bits >> 40) + 1) * 0x1p-24f, u2 = float(bits & 0xFFFFFF) * 0x1p-24f;
    values[i] = __float2bfloat16(stddev * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

}  // namespace

void DeviceBuffer::fill_normal(double stddev, uint64_t seed) {
  const int64_t count = int64_t(bytes_ / sizeof(__nv_bfloat16));
  if (count == 0) return;
  fill_normal_bf16<<<1024, 256>>>(as<__nv_bfloat16>(), count, seed, float(stddev));
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaDeviceSynchronize());
}

}  // namespace moka::cli
