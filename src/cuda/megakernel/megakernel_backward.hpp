// The backward megakernel on the GPU (docs/MEGAKERNEL.md, "The backward on the GPU"): one
// persistent kernel that follows core/megakernel_backward_plan.hpp. Its comm CTAs pull d_out
// rows and route weights into the ring and push d_x rows and d_topk_weights to their origin
// slots; its compute CTAs run the shared expert's and the routed experts' dgd, dx and weight-
// gradient tiles on the megakernel's GEMM core (mk_tile_gemm.cuh). Context modes
// (core::ContextMode): resident reads the forward's grouped rows of x, g and u; replay pulls x
// from its origin rank again and recomputes g, u (the forward's gate|up tile, its bits).
//
// This header is plain C++ (no CuTe): the launch's pointers and sizes, and the host-side owner of
// the kernel's workspace. The TMA descriptors are made in megakernel_backward_kernel.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/activation.hpp"
#include "core/megakernel_backward_plan.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/megakernel/megakernel_launch.hpp"
#include "moka/config.hpp"
#include "moka/megakernel.hpp"

namespace moka::cuda {

// The backward's first failure beside the forward's status word: the task that timed out and
// the counter it waited on (the forward's status names forward stages only).
struct BackwardWaitReport {
  core::BackwardTaskKind kind = core::BackwardTaskKind::none;
  core::BackwardCounterKind counter = core::BackwardCounterKind::none;
  int64_t step = -1, row_tile = 0, col_tile = 0, segment = -1, at = 0, target = 0, observed = 0;
};
struct BackwardControl {
  MegakernelControl base;  // arrivals, tickets, first-failure claim and status (pipeline waits)
  BackwardWaitReport wait;
};

// What one backward call reads and writes (device pointers). Peers' arrays have world_size
// entries; at EP = 1 they hold this rank's own buffers.
struct MegakernelBackwardIo {
  const int32_t* offsets = nullptr;      // [E_local + 1] the forward's padded expert segments
  const int32_t* slot_of_row = nullptr;  // [capacity rows] source * T*k + token*k + j, -1 = padding

  const bf16* const* d_out_peers = nullptr;   // [world] every rank's d_out [T, H] (pull)
  const float* const* weight_peers = nullptr;  // [world] every rank's route weights [T*k] (pull)
  bf16* const* dx_slot_peers = nullptr;       // [world] every rank's d_x slots [T*k, H] (push)
  float* const* dw_slot_peers = nullptr;      // [world] every rank's d_topk_weights [T*k] (push)

  const bf16* const* x_peers = nullptr;  // [world] every rank's x [T, H] (replay: pulled again)
  const bf16* x = nullptr;      // this rank's tokens [T, H] (shared expert)
  const bf16* d_out = nullptr;  // this rank's d_out [T, H] (shared expert)
  const bf16* dx_slots = nullptr;  // this rank's own d_x slots (dx_slot_peers[rank])
  // Resident context (replay: unread): the forward's grouped rows (row index = grouped row;
  // padding rows finite) and the shared expert's g, u.
  const bf16 *context_x = nullptr, *context_gate = nullptr, *context_up = nullptr;  // [rows, H], [rows, I] x2
  const bf16 *shared_gate = nullptr, *shared_up = nullptr;                          // [T, Is]

  const bf16 *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;     // [E, I, H], [E, I, H], [E, H, I]
  const bf16 *ws_gate = nullptr, *ws_up = nullptr, *ws_down = nullptr;  // [Is, H], [Is, H], [H, Is]

  bf16* d_x = nullptr;  // [T, H]
  bf16 *d_w_gate = nullptr, *d_w_up = nullptr, *d_w_down = nullptr;
  bf16 *d_ws_gate = nullptr, *d_ws_up = nullptr, *d_ws_down = nullptr;
};

// One launch: the worst-case plan and every buffer (the Io's and the workspace's).
struct MegakernelBackwardLaunch {
  core::MegakernelBackwardPlan plan;  // worst case; every CTA trims it to offsets[E] rows
  int num_ctas = 0, num_comm_ctas = 0;
  int64_t tokens = 0, top_k = 0, hidden = 0, intermediate = 0, shared_intermediate = 0, local_experts = 0;
  core::ActParams act;
  uint64_t timeout_ns = 0;
  MegakernelBackwardIo io;

  // Ring ([ring_rows, width]) and the shared expert's rows ([T rounded up to tile_m, width]).
  bf16 *ring_d_out = nullptr, *ring_x = nullptr, *ring_dx = nullptr;         // H wide
  bf16 *ring_dg = nullptr, *ring_du = nullptr, *ring_hs = nullptr;           // I wide
  bf16 *ring_gate = nullptr, *ring_up = nullptr;                             // I wide, replay only
  float *ring_weight = nullptr, *ring_partials = nullptr;                    // 1, dgd_col_tiles wide
  bf16 *shared_dg = nullptr, *shared_du = nullptr, *shared_hs = nullptr;     // Is wide
  bf16 *recomputed_shared_gate = nullptr, *recomputed_shared_up = nullptr;   // Is wide, replay only
  bf16* shared_dx = nullptr;                                                 // [T, H]
  float* shared_partials = nullptr;  // [T, shared dgd column tiles]: written, not read
  const float* ones = nullptr;       // [T]: the shared expert's route weight
  float* carries = nullptr;          // (max_macrobatches - 1) x backward_carry_floats
  int64_t* expert_offset = nullptr;  // [E_local + 1] offsets as int64 (the segment builder's input)
  core::WeightGradSegment* segments = nullptr;  // [max_segments]
  int64_t* first_of_step = nullptr;             // [max_steps + 1]
  int64_t* counters = nullptr;                  // core::counter_count(plan), zeroed per launch
  BackwardControl* control = nullptr;
};

// fp32 elements of one macrobatch boundary's carry on the GPU: dW_gate|up as the pair tiles
// compute them ([H, 2 * I rounded up to 128]: column tile c holds 128 gate columns then 128 up
// columns, read back only by the same tile) and dW_down [H, I].
MOKA_HD int64_t backward_carry_floats(int64_t hidden, int64_t intermediate) {
  return hidden * (2 * ((intermediate + 127) / 128 * 128) + intermediate);
}

// The GPU's tiling of the backward plan: tile_m 128, 256-column single tiles, 128-column pairs.
inline constexpr core::BackwardTiling kBackwardGpuTiling{256, 128};

// Enqueues, on `stream`: the segment table (built on the device from the offsets; a schedule
// over capacity writes the status word), the persistent kernel (cooperative launch, one CTA per
// SM or launch.num_ctas), then d_x = shared dx + sum_j d_x slots[t*k+j] (fp32, j in order) and
// zero weight gradients for experts without rows. At EP > 1 a device barrier belongs between the
// kernel and the d_x sum (every push landed); at EP = 1 the stream orders them.
void launch_megakernel_backward(const MegakernelBackwardLaunch& launch, cudaStream_t stream);
size_t megakernel_backward_smem_bytes();
// Sets the kernel's shared-memory attribute (once, outside any graph capture) and returns how
// many CTAs fit on one SM (must be >= 1: one CTA per SM, all resident).
int megakernel_backward_ctas_per_sm();

// Writes `count` (<= 8) pointers into the device array `table` on `stream` (a kernel: capturable,
// unlike a copy from pageable host memory): the one-entry peer tables of a one-rank call.
struct PointerValues {
  const void* at[8] = {};
  int count = 0;
};
void write_pointer_table(void** table, const PointerValues& values, cudaStream_t stream);

// Owner of the backward's workspace for one shape, config, context mode and up to `max_tokens`
// tokens per call.
class MegakernelBackward {
 public:
  // num_ctas 0: one CTA per SM. config.tile_rows must be 128 (the GEMM core's tile).
  MegakernelBackward(const MoeShape& shape, const MegakernelConfig& config, int world_size, int64_t max_tokens,
                     core::ContextMode mode = core::ContextMode::resident, int num_ctas = 0);
  // The workspace's plan (max_tokens).
  const core::MegakernelBackwardPlan& plan() const { return plan_; }
  bool replay() const { return plan_.mode == core::ContextMode::replay; }
  // Enqueues one call of `tokens` (<= max_tokens) on `stream` (no host synchronization;
  // capturable).
  void run(const MegakernelBackwardIo& io, int64_t tokens, cudaStream_t stream);
  // After the stream is synchronized: throws the kernel's first failure (capacity, a timed-out
  // wait naming the task and counter, a stalled pipeline), if any, once.
  void check_errors();

 private:
  MoeShape shape_;
  MegakernelConfig config_;
  int world_;
  int64_t max_tokens_;
  core::MegakernelBackwardPlan plan_, last_plan_;
  int num_ctas_ = 0;
  DeviceArray<bf16> ring_bf16_, shared_bf16_;
  DeviceArray<float> ring_float_, shared_partials_, ones_, carries_;
  DeviceArray<int64_t> expert_offset_, first_of_step_, counters_;
  DeviceArray<core::WeightGradSegment> segments_;
  DeviceArray<BackwardControl> control_;
};

}  // namespace moka::cuda
