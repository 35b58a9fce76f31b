// The persistent forward megakernel: grid = one CTA per SM; the first num_comm_ctas CTAs to
// arrive run the communication role (comm.cuh), the others the compute role (forward_compute.cuh).
// Each role takes tasks in the plan's global order through its own atomic ticket
// (core/megakernel_plan.hpp) and waits only on counters that earlier tasks release, so it
// finishes for any routing.
#include "cuda/common/check.hpp"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/comm.cuh"
#include "cuda/megakernel/forward_compute.cuh"
#include "cuda/megakernel/sync.cuh"

namespace moka::cuda {
namespace {

struct KernelParams {
  MegakernelLaunch launch;
  mk::Operands ops;
};

__global__ void __launch_bounds__(mk::kThreads, 1) megakernel(const __grid_constant__ KernelParams params) {
  const MegakernelLaunch& p = params.launch;
  const int cta = mk::arrival_index(p.control);
  if (cta < 0) return;  // the schedule already failed (capacity, bad routing)
  const core::MegakernelPlan plan = core::trim_to_rows(p.plan, p.offsets[p.local_experts]);
  extern __shared__ char smem_raw[];
  if (cta < p.num_comm_ctas) {
    auto& table = *reinterpret_cast<mk::RowTable*>(smem_raw);
    mk::task_loop(p, plan, cta, &p.control->comm_ticket, core::comm_task_count(plan), p.timeline_comm, core::comm_task,
                  [&](const core::Task& t) { mk::run_comm_task(p, plan, t, table); });
    return;
  }
  // The swizzled operand tiles need 1024-byte alignment.
  auto* smem = reinterpret_cast<mk::ComputeSmem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  mk::run_compute_cta(*smem, p, params.ops, plan, cta);
}

mk::Operands make_operands(const MegakernelLaunch& p) {
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, E = p.local_experts;
  const int64_t ring = p.plan.ring_rows;
  mk::Operands ops;
  ops.x_local = mk::make_operand(p.x_local, p.tokens, H, 1);
  ops.ring_x = mk::make_operand(p.ring_x, ring, H, 1);
  ops.ring_hidden = mk::make_operand(p.ring_hidden, ring, I, 1);
  ops.w_gate = mk::make_operand(p.w_gate, I, H, E);
  ops.w_up = mk::make_operand(p.w_up, I, H, E);
  ops.w_down = mk::make_operand(p.w_down, H, I, E);
  if (!p.gate_by_slot) {
    ops.ring_gate = mk::make_output(p.ring_gate, ring, I);
    ops.ring_up = mk::make_output(p.ring_up, ring, I);
  }
  ops.ring_hidden_out = mk::make_output(p.ring_hidden, ring, I);
  if (!p.y_by_slot) ops.ring_y = mk::make_output(p.ring_y, ring, H);
  if (Is > 0) {
    ops.shared_hidden = mk::make_operand(p.shared_hidden, p.tokens, Is, 1);
    ops.ws_gate = mk::make_operand(p.ws_gate, Is, H, 1);
    ops.ws_up = mk::make_operand(p.ws_up, Is, H, 1);
    ops.ws_down = mk::make_operand(p.ws_down, H, Is, 1);
    ops.shared_gate = mk::make_output(p.shared_gate, p.tokens, Is);
    ops.shared_up = mk::make_output(p.shared_up, p.tokens, Is);
    ops.shared_hidden_out = mk::make_output(p.shared_hidden, p.tokens, Is);
    ops.shared_out = mk::make_output(p.shared_out, p.tokens, H);
  }
  return ops;
}

}  // namespace

size_t megakernel_smem_bytes() { return mk::kComputeSmemBytes + 1024; }

int megakernel_ctas_per_sm() {
  const int smem = int(megakernel_smem_bytes());
  MOKA_CUDA_CHECK(cudaFuncSetAttribute(megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int ctas = 0;
  MOKA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, megakernel, mk::kThreads, smem));
  return ctas;
}

void launch_megakernel(const MegakernelLaunch& launch, cudaStream_t stream) {
  // CUDA 12.1+ takes up to 32764 bytes of kernel parameters on Hopper.
  static_assert(sizeof(KernelParams) <= 32764, "kernel parameters must fit the 32 KiB limit");
  const KernelParams params{launch, make_operands(launch)};
  mk::launch_cooperative(megakernel, params, launch.num_ctas, mk::kThreads, megakernel_smem_bytes(), stream);
}

}  // namespace moka::cuda
