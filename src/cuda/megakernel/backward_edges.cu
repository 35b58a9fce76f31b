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

// 8 bf16 values: one 16-byte load or store (every buffer here is 16-byte aligned: moka's own,
// and the caller's d_x and gradients by the layer's check).
struct alignas(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

// d_x[t, c..c+8) = shared dx + sum_j slot j of token t in fp32, j in order. EP = 1 (the dx tiles
// stored into the slots): slot 0 is d_x itself, slot j >= 1 row t*(k-1) + j-1 of the d_x slots.
__device__ void sum_dx(const MegakernelBackwardLaunch& p, int64_t t, int64_t c) {
  const int64_t H = p.hidden, k = p.top_k, at = t * H + c;
  float sum[8] = {};
  auto add = [&](const bf16* row) {
    const Bf16x8 v = *reinterpret_cast<const Bf16x8*>(row);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(v.v[i]);
      sum[2 * i] = __fadd_rn(sum[2 * i], f.x);
      sum[2 * i + 1] = __fadd_rn(sum[2 * i + 1], f.y);
    }
  };
  if (p.shared_intermediate > 0) add(p.shared_dx + at);
  if (p.io.dx_into_slots) {
    add(p.io.d_x + at);
    for (int64_t j = 1; j < k; ++j) add(p.io.dx_slots + (t * (k - 1) + j - 1) * H + c);
  } else {
    for (int64_t j = 0; j < k; ++j) add(p.io.dx_slots + (t * k + j) * H + c);
  }
  Bf16x8 out;
#pragma unroll
  for (int i = 0; i < 4; ++i) out.v[i] = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
  *reinterpret_cast<Bf16x8*>(p.io.d_x + at) = out;
}

// After the kernel (and, at EP > 1, the barrier): d_x = shared dx + sum_j slots[t*k+j]
// (sum_dx, 8 columns a thread: H is a multiple of 8); zero weight gradients for experts without
// rows (they have no weight-gradient task), with no work per element of the experts with rows.
__global__ void backward_epilogue_kernel(const MegakernelBackwardLaunch p) {
  const int64_t H = p.hidden, I = p.intermediate, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, per_row = H / 8;
  for (int64_t v = first; v < p.tokens * per_row; v += stride) {
    const int64_t t = v / per_row;
    sum_dx(p, t, (v - t * per_row) * 8);
  }
  const int64_t slab = I * H;  // elements of each of an expert's three gradients
  Bf16x8 zeros;
#pragma unroll
  for (int i = 0; i < 4; ++i) zeros.v[i] = __floats2bfloat162_rn(0.f, 0.f);
  for (int64_t e = 0; e < p.local_experts; ++e) {
    if (p.io.offsets[e + 1] != p.io.offsets[e]) continue;
    for (bf16* g : {p.io.d_w_gate, p.io.d_w_up, p.io.d_w_down})
      for (int64_t v = first; v < slab / 8; v += stride) reinterpret_cast<Bf16x8*>(g + e * slab)[v] = zeros;
  }
}

}  // namespace
}  // namespace mk

void launch_backward_segments(const MegakernelBackwardLaunch& launch, cudaStream_t stream) {
  mk::build_segments_kernel<<<1, 1, 0, stream>>>(launch);
  MOKA_CUDA_CHECK_LAUNCH();
}

void launch_backward_epilogue(const MegakernelBackwardLaunch& launch, cudaStream_t stream) {
  // Enough threads to keep HBM busy on the d_x sum (an H200 twice over; the loops stride the rest).
  mk::backward_epilogue_kernel<<<2 * 132 * 8, 256, 0, stream>>>(launch);
  MOKA_CUDA_CHECK_LAUNCH();
}

void load_backward_edge_kernels() {
  cudaFuncAttributes attributes;
  MOKA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, mk::build_segments_kernel));
  MOKA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, mk::backward_epilogue_kernel));
}

}  // namespace moka::cuda
