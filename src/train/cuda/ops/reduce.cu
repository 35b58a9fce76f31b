// reduce.cuh: kReduceBlocks block sums (each in lane then warp order), then one block over them.
// grad_square_partials runs each slot's partials with the same per-block loop as reduce_partials,
// hence the same bits as one reduce_partials per tensor.
#include "train/cuda/ops/kernel_helpers.cuh"
#include "train/cuda/ops/reduce.cuh"

namespace moka::train::cuda {
namespace {

// Partial `part` of kReduceBlocks over x: a grid-stride loop as if it were block `part` of a
// kReduceBlocks-block launch.
__device__ void reduce_part(ReduceOp op, const void* x, bool is_bf16, int64_t n, int part, double* out) {
  double acc = 0;
  for (int64_t i = int64_t(part) * blockDim.x + threadIdx.x; i < n; i += int64_t(kReduceBlocks) * blockDim.x) {
    const double v =
        is_bf16 ? double(__bfloat162float(static_cast<const bf16*>(x)[i])) : double(static_cast<const float*>(x)[i]);
    acc += op == ReduceOp::sum ? v : op == ReduceOp::abs ? fabs(v) : v * v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

__global__ void reduce_partials_kernel(ReduceOp op, const void* x, bool is_bf16, int64_t n, double* partials) {
  reduce_part(op, x, is_bf16, n, blockIdx.x, partials + blockIdx.x);
}

// Block b: partial b % kReduceBlocks of slot b / kReduceBlocks.
__global__ void grad_square_partials_kernel(const TensorSlot* slots, double* partials) {
  const TensorSlot& t = slots[blockIdx.x / kReduceBlocks];
  reduce_part(ReduceOp::square, t.grad, t.grad_bf16, t.n, blockIdx.x % kReduceBlocks, partials + blockIdx.x);
}

__global__ void reduce_finish_kernel(const double* partials, int64_t count, double scale, double* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = scale * acc;
}

}  // namespace

void reduce_partials(ReduceOp op, const void* x, bool is_bf16, int64_t n, double* partials, cudaStream_t s) {
  reduce_partials_kernel<<<kReduceBlocks, kThreads, 0, s>>>(op, x, is_bf16, n, partials);
}

void reduce_finish(const double* partials, int64_t count, double scale, double* out, cudaStream_t s) {
  reduce_finish_kernel<<<1, kThreads, 0, s>>>(partials, count, scale, out);
}

void grad_square_partials(const TensorSlot* slots, int count, double* partials, cudaStream_t s) {
  grad_square_partials_kernel<<<unsigned(count) * kReduceBlocks, kThreads, 0, s>>>(slots, partials);
}

}  // namespace moka::train::cuda
