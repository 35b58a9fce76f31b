// selection_bias.cuh in one block (a router has few experts); the mean count is an exact integer
// sum, so the signs (ties included) are the host's.
#include "train/cuda/ops/kernel_helpers.cuh"
#include "train/cuda/ops/selection_bias.cuh"

namespace moka::train::cuda {
namespace {

// One block: the mean over experts (an exact integer sum), then each expert's step.
__global__ void selection_bias_kernel(const int32_t* counts, int64_t experts, double rate, double* bias,
                                      float* bias32) {
  __shared__ double mean;
  if (threadIdx.x == 0) {
    long long total = 0;
    for (int64_t e = 0; e < experts; ++e) total += counts[e];
    mean = double(total) / double(experts);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const double c = double(counts[e]);
    const double b = bias[e] + rate * (c < mean ? 1.0 : (c > mean ? -1.0 : 0.0));
    bias[e] = b;
    bias32[e] = float(b);
  }
}

}  // namespace

void update_selection_bias(const int32_t* counts, int64_t experts, double rate, double* bias, float* bias32,
                           cudaStream_t s) {
  selection_bias_kernel<<<1, kThreads, 0, s>>>(counts, experts, rate, bias, bias32);
}

}  // namespace moka::train::cuda
