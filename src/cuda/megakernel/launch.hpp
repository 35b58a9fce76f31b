// What one launch of the forward megakernel reads and writes (plain pointers and sizes; the
// TMA descriptors are made from them in forward_kernel.cu, the only file that sees CuTe).
// The host side (layer.cu) owns the buffers; docs/MEGAKERNEL.md has the design.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/activation.hpp"
#include "core/megakernel_plan.hpp"
#include "moka/config.hpp"
#include "moka/error.hpp"
#include "moka/megakernel.hpp"

namespace moka::cuda {

using bf16 = __nv_bfloat16;

// Per-launch control words, zeroed in the stream before the schedule kernels (so a captured
// graph resets them on every replay): the CTA arrival counter that assigns roles, the two task
// tickets, the first-failure claim and the status the host reads after the closing barrier.
struct MegakernelControl {
  unsigned int arrivals;
  unsigned long long compute_ticket;
  unsigned long long comm_ticket;
  int32_t claim;
  core::MegakernelStatus status;
  unsigned long long bad_route;  // ~(source * T*k + slot) of the lowest invalid id, 0 = none
};

// One timeline record per task (only when the caller asked for a timeline).
struct TimelineRecord {
  int64_t start_ns, end_ns;
  int32_t cta, kind;  // cta: the CTA's arrival index (its role order); kind: core::TaskKind
  int64_t step, row_tile;
};

struct MegakernelLaunch {
  core::MegakernelPlan plan;  // worst case; every CTA trims it to offsets[E] rows
  int num_ctas = 0, num_comm_ctas = 0;
  int64_t tokens = 0, top_k = 0, hidden = 0, intermediate = 0, shared_intermediate = 0, local_experts = 0;
  core::ActParams act;
  uint64_t timeout_ns = 0;

  const int32_t* offsets = nullptr;      // [E + 1] padded expert segments of the receive schedule
  const int32_t* slot_of_row = nullptr;  // [capacity_rows] source * T*k + token*k + j, -1 = padding

  bf16* const* x_peers = nullptr;        // [world] symmetric x of every rank ([T, H])
  bf16* const* combine_peers = nullptr;  // [world] symmetric combine buffer of every rank ([T*k, H])
  const bf16* x_local = nullptr;         // this rank's symmetric x (shared-expert input)

  const bf16 *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;     // [E, I, H], [E, I, H], [E, H, I]
  const bf16 *ws_gate = nullptr, *ws_up = nullptr, *ws_down = nullptr;  // [Is, H], [Is, H], [H, Is]

  bf16 *ring_x = nullptr, *ring_gate = nullptr, *ring_up = nullptr, *ring_hidden = nullptr, *ring_y = nullptr;
  // A resident context kept by slot ([world * T*k, I] each, SavedRows): the gate|up tiles store
  // g and u there (by slot_of_row) instead of ring_gate and ring_up, which are then null.
  bf16 *gate_by_slot = nullptr, *up_by_slot = nullptr;
  bf16 *shared_gate = nullptr, *shared_up = nullptr, *shared_hidden = nullptr, *shared_out = nullptr;
  // EP = 1: the down tiles store y by slot into the combine slots [T*k, H] (y_by_slot), from
  // registers; the combine copies nothing and ring_y is null.
  bf16* y_by_slot = nullptr;

  int64_t* counters = nullptr;  // core::counter_count(plan), zeroed per launch
  MegakernelControl* control = nullptr;
  TimelineRecord* timeline_compute = nullptr;  // [compute_task_count(worst plan)] or null
  TimelineRecord* timeline_comm = nullptr;     // [comm_task_count(worst plan)] or null
};

// A launch's plan, grid and sizes (no buffers yet): `local_experts` experts on this rank,
// `num_sms` CTAs.
MegakernelLaunch sized_launch(const core::MegakernelPlan& plan, const MoeShape& shape, const MegakernelConfig& config,
                              int64_t tokens, int64_t local_experts, int num_sms);

// Bytes of dynamic shared memory per CTA (one CTA per SM).
size_t megakernel_smem_bytes();
// Enqueues the persistent kernel on `stream` (grid = launch.num_ctas, one CTA per SM) as a
// cooperative launch: the runtime refuses a grid whose CTAs cannot all be resident at once.
// Roles go by arrival order (the first num_comm_ctas CTAs to start communicate), so progress
// never depends on which CTAs the hardware schedules first; num_comm_ctas = 0 runs the compute
// role alone (MegakernelCore).
void launch_megakernel(const MegakernelLaunch& launch, cudaStream_t stream);

}  // namespace moka::cuda

namespace moka::cuda {

// Sets the kernel's shared-memory attribute and returns how many CTAs fit on one SM (must be
// >= 1: the grid is one CTA per SM, all resident, which the progress argument needs).
int megakernel_ctas_per_sm();

// The SMs the current context may run work on, which the persistent grids are sized to: the
// device's count, lowered where the context owns part of the GPU: an MPS client's active-thread
// limit or an SM-count execution affinity (cuCtxGetExecAffinity) and a green context's SM
// resource (cuCtxGetDevResource). A grid of the device's count would be refused as a cooperative
// launch there.
int context_sm_count();

// ---- Routing exchange and schedule checks (schedule.cu) ---------------------------

// Each rank's region of every peer's symmetric routing buffer: a header (its token count) and
// its T*k expert ids, at [rank * routing_region_ints(max_tokens, k)].
MOKA_HD int64_t routing_region_ints(int64_t max_tokens, int64_t top_k) { return 4 + max_tokens * top_k; }

struct RoutingExchange {
  int32_t* const* peers = nullptr;  // [world] every rank's symmetric routing buffer
  int world_size = 1, rank = 0;
  int64_t tokens = 0, top_k = 0, max_tokens = 0;
};
// Writes this rank's header and ids into every peer's buffer (stores over NVLink).
void exchange_routing(const RoutingExchange& x, const int32_t* topk_ids, cudaStream_t stream);

// The device tables the kernel reads, made from the local routing buffer after the barrier.
struct ScheduleCheck {
  const int32_t* routing = nullptr;  // this rank's symmetric routing buffer (every source's region)
  int world_size = 1;
  int64_t tokens = 0, top_k = 0, max_tokens = 0, global_experts = 0, local_experts = 0;
  int64_t capacity_rows = 0;
  const int32_t* offsets = nullptr;      // [E + 1] from build_schedule
  const int32_t* row_of_slot = nullptr;  // [world * T*k]
  int32_t* slot_of_row = nullptr;        // [capacity_rows], written here
  MegakernelControl* control = nullptr;
  const uint64_t* barrier_error = nullptr;  // the group's device-barrier error word (null: no group)
};
// Copies every source's ids into `ids` ([world][T*k], contiguous, for build_schedule), inverts
// row_of_slot into slot_of_row, and writes the status word when the barrier before it timed out
// (peer_missing: the megakernel then pulls nothing), a source's token count differs, an id is out
// of range (the lowest (source, slot) is reported) or the rows exceed capacity.
void gather_source_ids(const ScheduleCheck& c, int32_t* ids, cudaStream_t stream);
void finish_schedule(const ScheduleCheck& c, cudaStream_t stream);

// A resident forward's g and u (saved_rows.cu): the backward megakernel reads and writes them as
// grouped rows (each local expert's segment padded to whole row tiles, ring row = grouped row);
// the context keeps them by slot (source * T*k + slot, the index slot_of_row holds), which is
// T*k rows per rank's tokens however the routes fall, instead of the padded capacity. The
// forward megakernel stores them by slot (MegakernelLaunch::gate_by_slot); the backward unpacks
// them, one of the two at a time, so that only one of them is held twice while it is copied.
struct SavedRows {
  const int32_t* slot_of_row = nullptr;    // [grouped_rows]: each grouped row's slot, -1 for padding
  const int32_t* schedule_rows = nullptr;  // offsets[E]: the rows of the schedule's tiles
  int64_t grouped_rows = 0;                // the capacity the schedule was built for
  int64_t slots = 0;                       // world * T*k
  int64_t width = 0;                       // I (a multiple of 8)
  bf16* grouped = nullptr;                 // [grouped_rows, width]
  bf16* by_slot = nullptr;                 // [slots, width]
};
// grouped[row] = by_slot[slot] for every routed row, and zeros in the padding rows of the
// schedule's tiles (the backward's dgd tiles read whole tiles of g and u and weigh the padding
// rows by 0, which needs finite values). Rows past the schedule's and slots no local expert
// holds are neither read nor written.
void unpack_saved_rows(const SavedRows& rows, cudaStream_t stream);

// The first failure of any rank, as every rank reports it.
struct MergedStatus {
  int32_t rank = -1;  // -1: no rank failed
  core::MegakernelStatus status;
};
// After the megakernel: this rank's status into its slot of the symmetric status buffer.
void publish_status(const MegakernelControl* control, core::MegakernelStatus* own_slot, cudaStream_t stream);
// After the closing barrier: the lowest failing rank's status of all slots, into `merged`
// (mapped host memory).
void merge_status(core::MegakernelStatus* const* peer_slots, int world_size, MergedStatus* merged, cudaStream_t stream);

// The outputs of one call (device buffers of bf16 or fp32 values) that fill_nan_on_failure fills
// with NaN when the call failed.
struct CallOutputs {
  static constexpr int kMax = 8;
  void* at[kMax] = {};
  size_t bytes[kMax] = {};
  int count = 0;
  void add(void* data, size_t size) {
    if (data == nullptr || size == 0) return;
    require(count < kMax, ErrorCode::invalid_argument, "a call has more outputs than CallOutputs holds");
    at[count] = data;
    bytes[count++] = size;
  }
};
// After a call's last kernel: when *code (a merged status, device or mapped host memory) is not
// ok, or *routing_error (null: not checked) holds a routing error, fills every output with NaN
// (0x7fc0 in every 16-bit half: a bf16 NaN, and a NaN as fp32 too), so that nothing downstream
// consumes a failed call's outputs as numbers. `flag`: one device int of the caller's, which a
// single thread sets from the status words before the fill's CTAs read it (when the call
// succeeded they read it and leave).
void fill_nan_on_failure(const core::StatusCode* code, const unsigned long long* routing_error, int* flag,
                         const CallOutputs& outputs, cudaStream_t stream);

}  // namespace moka::cuda
