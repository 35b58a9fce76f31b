// The small kernels around the persistent backward megakernel (backward_kernel.cu): the segment
// table before it, the d_x sum and the zero gradients of experts without rows after it.
#include "cuda/common/check.hpp"
#include "cuda/megakernel/backward.hpp"
#include "cuda/megakernel/sync.cuh"

namespace moka::cuda {
namespace mk {
namespace {

using core::MegakernelBackwardPlan;

// One thread: the segment table of this call's rows (the plan's own fill functions), or the
// failure in the status word (every CTA of the megakernel then leaves at once): at EP > 1 an
// opening barrier that timed out (the peers' d_out, weights and slots may still be in use, so
// nothing is pulled or pushed), else a schedule over capacity.
__global__ void build_segments_kernel(const MegakernelBackwardLaunch p) {
  const uint64_t missing = p.barrier_error ? atomic_load<MemoryOrder::relaxed, Scope::sys>(p.barrier_error) : 0;
  if (missing != 0) {
    core::MegakernelStatus s;
    s.code = core::StatusCode::peer_missing;
    s.source_rank = static_cast<int64_t>(missing) - 1;
    report(&p.control->base, s);
    return;
  }
  const int64_t rows = p.io.offsets[p.local_experts];
  if (!core::fits_capacity(p.plan, rows)) {
    core::MegakernelStatus s;
    s.code = core::StatusCode::capacity_exceeded;
    s.rows = rows;
    s.capacity = p.plan.capacity_rows;
    report(&p.control->base, s);
    return;
  }
  const MegakernelBackwardPlan plan = core::backward_trim_to_rows(p.plan, rows);
  for (int64_t e = 0; e <= p.local_experts; ++e) p.expert_offset[e] = p.io.offsets[e];
  const int64_t count = core::fill_weight_grad_segments(plan, p.expert_offset, p.local_experts, p.segments);
  core::fill_segment_steps(plan, p.segments, count, p.first_of_step);
}

// After the kernel (and, at EP > 1, the barrier): d_x = shared dx + sum_j slots[t*k+j] in fp32,
// j in order; zero weight gradients for experts without rows (they have no weight-gradient task).
__global__ void backward_epilogue_kernel(const MegakernelBackwardLaunch p) {
  const int64_t H = p.hidden, I = p.intermediate, k = p.top_k, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t at = first; at < p.tokens * H; at += stride) {
    const int64_t t = at / H, c = at % H;
    float sum = p.shared_intermediate > 0 ? __bfloat162float(p.shared_dx[at]) : 0.f;
    for (int64_t j = 0; j < k; ++j) sum = __fadd_rn(sum, __bfloat162float(p.io.dx_slots[(t * k + j) * H + c]));
    p.io.d_x[at] = __float2bfloat16_rn(sum);
  }
  const bf16 zero = __float2bfloat16_rn(0.f);
  for (int64_t at = first; at < p.local_experts * I * H; at += stride) {
    const int64_t e = at / (I * H);
    if (p.io.offsets[e + 1] != p.io.offsets[e]) continue;
    p.io.d_w_gate[at] = zero;
    p.io.d_w_up[at] = zero;
    p.io.d_w_down[at] = zero;
  }
}

}  // namespace
}  // namespace mk

void launch_backward_segments(const MegakernelBackwardLaunch& launch, cudaStream_t stream) {
  mk::build_segments_kernel<<<1, 1, 0, stream>>>(launch);
  MOKA_CUDA_CHECK_LAUNCH();
}

void launch_backward_epilogue(const MegakernelBackwardLaunch& launch, cudaStream_t stream) {
  mk::backward_epilogue_kernel<<<256, 256, 0, stream>>>(launch);
  MOKA_CUDA_CHECK_LAUNCH();
}

void load_backward_edge_kernels() {
  cudaFuncAttributes attributes;
  MOKA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, mk::build_segments_kernel));
  MOKA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, mk::backward_epilogue_kernel));
}

}  // namespace moka::cuda
