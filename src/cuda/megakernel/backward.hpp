// The backward megakernel on the GPU (docs/MEGAKERNEL.md, "The backward on the GPU"): one
// persistent kernel that follows core/megakernel_backward_plan.hpp. Its comm CTAs pull d_out
// rows and route weights into the ring and push d_x rows and d_topk_weights to their origin
// slots; its compute CTAs run the shared expert's and the routed experts' dgd, dx and weight-
// gradient tiles on the megakernel's GEMM core (tile_gemm.cuh). Context modes
// (core::ContextMode): resident reads the forward's grouped rows of g and u (and of x where the
// caller kept them, else it pulls x from its origin rank); replay pulls x and recomputes g, u
// (the forward's gate|up tile, its bits).
//
// This header is plain C++ (no CuTe): the launch's pointers and sizes, and the host-side owner of
// the kernel's workspace. The TMA descriptors are made in backward_kernel.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>

#include "core/activation.hpp"
#include "core/megakernel_backward_plan.hpp"
#include "core/megakernel_memory.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/common/stage_clock.hpp"
#include "cuda/megakernel/launch.hpp"
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
// A rank's first failure as every rank reads it (EP > 1: each rank's symmetric slot).
struct BackwardStatus {
  core::MegakernelStatus status;
  BackwardWaitReport wait;
};
// The lowest failing rank's status, merged on the device into mapped host memory.
struct MergedBackwardStatus {
  int32_t rank = -1;  // -1: no rank failed
  BackwardStatus failure;
};

// What one backward call reads and writes (device pointers). Peers' arrays have world_size
// entries; at EP = 1 they hold this rank's own buffers.
struct MegakernelBackwardIo {
  const int32_t* offsets = nullptr;      // [E_local + 1] the forward's padded expert segments
  const int32_t* slot_of_row = nullptr;  // [capacity rows] source * T*k + token*k + j, -1 = padding

  const bf16* const* d_out_peers = nullptr;    // [world] every rank's d_out [T, H] (pull)
  const float* const* weight_peers = nullptr;  // [world] every rank's route weights [T*k] (pull)
  bf16* const* dx_slot_peers = nullptr;        // [world] every rank's d_x slots [T*k, H] (push)
  float* const* dw_slot_peers = nullptr;       // [world] every rank's d_topk_weights [T*k] (push)

  const bf16* const* x_peers = nullptr;  // [world] every rank's x [T, H] (replay: pulled again)
  const bf16* x = nullptr;               // this rank's tokens [T, H] (shared expert)
  const bf16* d_out = nullptr;           // this rank's d_out [T, H] (shared expert)
  const bf16* dx_slots = nullptr;        // this rank's own d_x slots (dx_slot_peers[rank])
  // EP = 1: the dx tiles store each row's d_x straight into its slot (slot_of_row), as the push
  // would have copied it from the ring: the same bits, and no d_x rows in the ring (rows x H
  // fewer) nor copies in the push (dx_slot_peers is then unread). Slot 0 of token t is row t of
  // d_x itself (the epilogue adds the others to it), slot j >= 1 row t*(k-1) + j-1 of dx_slots
  // ([T*(k-1), H]).
  bool dx_into_slots = false;
  // Resident context (replay: unread): the forward's grouped rows (row index = grouped row;
  // padding rows are not read) and the shared expert's g, u. context_x may be null: x's rows are
  // pulled from their origin (x_peers) as in replay, and only g, u are kept.
  const bf16* context_x = nullptr;                      // [rows, H]
  bf16 *context_gate = nullptr, *context_up = nullptr;  // [rows, I] x2
  // Grouped rows that are the caller's to give up (the layer's copy unpacked from a context):
  // dg and du are written over context_gate and context_up, two I-wide ring buffers fewer. Each dgd tile reads its g and u before it
  // writes the same elements, and nothing reads them after; with one macrobatch (the resident
  // layer's) ring row r is grouped row r. Otherwise the ring's own buffers are used.
  bool overwrite_context = false;
  const bf16 *shared_gate = nullptr, *shared_up = nullptr;  // [T, Is]

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
  bf16 *ring_d_out = nullptr, *ring_x = nullptr, *ring_dx = nullptr;        // H wide (dx: null into slots)
  bf16 *ring_dg = nullptr, *ring_du = nullptr, *ring_hs = nullptr;          // I wide
  bf16 *ring_gate = nullptr, *ring_up = nullptr;                            // I wide, replay only
  float *ring_weight = nullptr, *ring_partials = nullptr;                   // 1, dgd_col_tiles wide
  bf16 *shared_dg = nullptr, *shared_du = nullptr, *shared_hs = nullptr;    // Is wide
  bf16 *recomputed_shared_gate = nullptr, *recomputed_shared_up = nullptr;  // Is wide, replay only
  bf16* shared_dx = nullptr;                                                // [T, H]
  float* shared_partials = nullptr;             // [T, shared dgd column tiles]: written, not read
  const float* ones = nullptr;                  // [T]: the shared expert's route weight
  float* carries = nullptr;                     // (max_macrobatches - 1) x backward_carry_floats
  int64_t* expert_offset = nullptr;             // [E_local + 1] offsets as int64 (the segment builder's input)
  core::WeightGradSegment* segments = nullptr;  // [max_segments]
  int64_t* first_of_step = nullptr;             // [max_steps + 1]
  int64_t* counters = nullptr;                  // core::counter_count(plan), zeroed per launch
  BackwardControl* control = nullptr;
  // EP > 1: the device-barrier error word read before the kernel (0: every rank arrived; else
  // 1 + the missing rank, and the kernel pulls nothing). Null at EP = 1.
  const uint64_t* barrier_error = nullptr;
};

// backward_carry_floats (a macrobatch boundary's fp32 carry) and the workspace's sizes:
// core/megakernel_memory.hpp.
using core::backward_carry_floats;

// The GPU's tiling of the backward plan: tile_m 128, 256-column single tiles, 128-column pairs.
inline constexpr core::BackwardTiling kBackwardGpuTiling = core::kGpuBackwardTiling;

// Enqueues, on `stream`: the segment table (built on the device from the offsets; a schedule
// over capacity or a barrier that timed out writes the status word) and the persistent kernel
// (cooperative launch, one CTA per SM or launch.num_ctas).
void launch_megakernel_backward(const MegakernelBackwardLaunch& launch, cudaStream_t stream);
// Enqueues d_x = shared dx + sum_j d_x slots[t*k+j] (fp32, j in order) and zero weight gradients
// for experts without rows: after the kernel and, at EP > 1, the closing barrier (every push
// landed).
void launch_backward_epilogue(const MegakernelBackwardLaunch& launch, cudaStream_t stream);
size_t megakernel_backward_smem_bytes();
// The segment-table kernel alone (backward_edges.cu; launch_megakernel_backward enqueues it), and
// the loading of it and of the epilogue kernel (load_megakernel_backward_kernels does it).
void launch_backward_segments(const MegakernelBackwardLaunch& launch, cudaStream_t stream);
void load_backward_edge_kernels();
// Loads the kernels launch_megakernel_backward and launch_backward_epilogue enqueue (outside any
// graph capture). With lazy module loading (CUDA's default) a kernel's first launch loads its
// module, which can wait for the device: while an earlier barrier on another stream spins on a
// rank whose work this host thread has not enqueued yet, that wait lasts until the barrier times
// out (two ranks driven by one thread, as the one-GPU test does).
void load_megakernel_backward_kernels();
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

// How the ranks of an EP > 1 call meet (unused at EP = 1). The kernel itself never waits on a
// peer: its pulls read peer buffers the opening barrier froze and its pushes write peer slots
// nobody reads before the closing barrier, so the ranks' kernels need not be resident together.
struct BackwardRanks {
  // Enqueues a bounded device barrier among the ranks on the stream (capturable).
  std::function<void(cudaStream_t)> barrier;
  const uint64_t* barrier_error = nullptr;        // device: the barrier's error word (0, or 1 + missing rank)
  BackwardStatus* const* status_peers = nullptr;  // device table [world]: every rank's status slot
  BackwardStatus* own_status = nullptr;           // this rank's slot (status_peers[rank])
};

// The backward for one shape, config, context mode and up to `max_tokens` tokens per call: its
// schedule tables, counters and status are its own; its ring and the shared expert's rows are
// each call's, from `allocator` (null: moka's pool) on the call's stream, sized for its tokens.
//
// At EP > 1 a call is collective: every rank runs it with the same token count, on symmetric
// buffers (the Io's peer tables): d_out and route weights written before run() (the pulls'
// sources), d_x slots and d_topk_weights slots (the pushes' targets). On the stream:
//   zero control and counters -> barrier (pull sources frozen; the peers' slots free) ->
//   segment table (a barrier timeout -> peer_missing: the kernel pulls nothing) -> kernel ->
//   status into this rank's slot -> barrier (every push landed, every pull of this rank done) ->
//   d_x sum -> missing-peer note (a barrier that timed out, into this rank's slot if it holds no
//   failure of its own, so a rank arriving late finds the call failed too) -> every rank's status
//   merged into mapped host memory (EP = 1: the kernel, then d_x sum, then its own status there).
class MegakernelBackward {
 public:
  // num_ctas 0: one CTA per SM. config.tile_rows must be 128 (the GEMM core's tile). world_size
  // > 1 needs `ranks` (barrier, error word, status slots).
  MegakernelBackward(const MoeShape& shape, const MegakernelConfig& config, int world_size, int64_t max_tokens,
                     core::ContextMode mode = core::ContextMode::resident, int num_ctas = 0, BackwardRanks ranks = {},
                     DeviceAllocator* allocator = nullptr);
  // The workspace's plan (max_tokens).
  const core::MegakernelBackwardPlan& plan() const { return plan_; }
  bool replay() const { return plan_.mode == core::ContextMode::replay; }
  // Enqueues one call of `tokens` (<= max_tokens) on `stream` (no host synchronization;
  // capturable). `clock` (may be null) gets the call's stages: setup, megakernel, epilogue.
  void run(const MegakernelBackwardIo& io, int64_t tokens, cudaStream_t stream, StageClock* clock = nullptr);
  // After the stream is synchronized: throws the first failure (capacity, a timed-out wait
  // naming the task and counter, a stalled pipeline; at EP > 1 the lowest failing rank's, or a
  // rank that did not arrive at a barrier: every rank reports it), if any, once.
  void check_errors();
  // check_errors() when the last call's work has finished; nothing (no waiting) while it runs or
  // while `stream` is being captured into a graph.
  void raise_finished_errors(cudaStream_t stream);
  // The last call's merged status code (mapped host memory, written at the end of the call): not
  // ok when it failed on any rank.
  const core::StatusCode* failure_code() const { return &merged_.device()->failure.status.code; }
  ~MegakernelBackward();
  MegakernelBackward(const MegakernelBackward&) = delete;
  MegakernelBackward& operator=(const MegakernelBackward&) = delete;

 private:
  void throw_failure(const BackwardStatus& failure, const std::string& prefix) const;

  MoeShape shape_;
  MegakernelConfig config_;
  int world_;
  BackwardRanks ranks_;
  DeviceAllocator* allocator_;
  int64_t max_tokens_;
  core::MegakernelBackwardPlan plan_, last_plan_;
  int num_ctas_ = 0;
  DeviceArray<float> ones_;  // [max_tokens]: the shared expert's route weight
  DeviceArray<int64_t> expert_offset_, first_of_step_, counters_;
  DeviceArray<core::WeightGradSegment> segments_;
  DeviceArray<BackwardControl> control_;
  PinnedWord<MergedBackwardStatus> merged_;  // every rank's first failure, merged on the device
  cudaEvent_t done_ = nullptr;               // the last call's end
  bool pending_ = false;                     // a call ran whose failures were not checked yet
};

}  // namespace moka::cuda
