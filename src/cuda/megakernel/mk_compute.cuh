// The megakernel's compute role: shared-expert and routed expert tiles on the GEMM core
// (mk_tile_gemm.cuh). A gate|up tile computes 128 rows x 128 hidden columns of both gate and
// up (one 128 x 256 accumulator: gate columns left, up columns right, sharing the A tile) and
// applies SwiGLU in its epilogue, writing gate, up and hidden (the saved context of backward);
// a down tile computes 128 x 256 of y.
// Numerics match the CUDA layer's (its gate GEMM's SwiGLU epilogue, swiglu_epilogue.cuh, and its
// unfused path alike): gate and up are rounded to bf16 before the activation, which is
// evaluated in fp32 (core/activation.hpp, the CPU reference's function).
//
// Roles of a compute CTA (384 threads), in the style of CUTLASS's sm90 warp-specialized kernels:
// - warp 0 (producer warpgroup): the TMA thread, loading the k-blocks of task after task;
// - warp 1 (producer warpgroup): the scheduler thread, taking compute tickets, waiting on the
//   tasks' counters (acquire + proxy fence) and publishing each task into a two-slot queue in
//   shared memory;
// - warpgroups 1 and 2: the consumers, running the MMAs and the epilogue, then releasing the
//   task's counter.
// A queue slot is free again once the TMA thread has issued its task's loads and the consumers
// have finished the task, so the scheduler holds at most one task beyond the one the consumers
// run: it acquires task n+1 while task n computes, and the TMA thread starts loading task n+1
// into the stages task n frees. Taking a ticket only when a slot frees keeps the plan's progress
// argument (core/megakernel_plan.hpp): a CTA holds a later task only while it runs an earlier
// one, which never waits on the later one.
#pragma once
#include <cuda_bf16.h>

#include <type_traits>

#include "core/activation.hpp"
#include "core/megakernel_plan.hpp"
#include "cuda/megakernel/megakernel_launch.hpp"
#include "cuda/megakernel/mk_sync.cuh"
#include "cuda/megakernel/mk_tile_gemm.cuh"

namespace moka::cuda::mk {

// Descriptors of every operand the compute tiles read (kernel parameters, __grid_constant__).
struct Operands {
  Operand x_local, ring_x, ring_hidden, shared_hidden;  // activations: [rows, K]
  Operand w_gate, w_up, w_down, ws_gate, ws_up, ws_down;  // weights: [E or 1, N, K]
};

// Where a tile's outputs go: rows [row0, row0 + valid_rows) and columns [col0, col0 + N) of
// row-major buffers `width` columns wide (columns past it are the last tile's overhang).
struct TileOut {
  int64_t row0, valid_rows, col0, width;
};

// One published task: what the TMA thread loads and what the consumers' epilogue writes.
struct ComputeJob {
  bool stop = true;  // no task: every role of the CTA leaves
  core::Task task;
  uint64_t ticket = 0;
  TaskSite site;
  TileLoads loads;
  bool swiglu = false;  // gate|up epilogue (out0..2 = gate, up, hidden), else plain (out0 = y)
  bf16 *out0 = nullptr, *out1 = nullptr, *out2 = nullptr;
  TileOut o{};
};

inline constexpr int kTaskSlots = 2;

// The task queue between the scheduler thread and the TMA thread and consumers.
struct TaskQueue {
  ComputeJob jobs[kTaskSlots];
  alignas(8) uint64_t published[kTaskSlots];  // one arrival: the scheduler wrote the slot
  // The TMA thread and every consumer thread arrive once they read the slot for the last time:
  // each reader's own arrival (and its own wait on `published`) orders its reads in a way
  // compute-sanitizer's racecheck follows, which a barrier relayed through one thread is not.
  alignas(8) uint64_t finished[kTaskSlots];
};
inline constexpr uint32_t kSlotReaders = 1 + kConsumerThreads;

struct ComputeSmem {
  TileSmem tile;
  TaskQueue queue;
};

__device__ inline void init_compute_smem(ComputeSmem& sm) {
  if (threadIdx.x == 0) {
    init_tile_pipeline(sm.tile);
    for (int q = 0; q < kTaskSlots; ++q) {
      EmptyBarrier::init(&sm.queue.published[q], 1);
      EmptyBarrier::init(&sm.queue.finished[q], kSlotReaders);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// ---- Tasks -> jobs -----------------------------------------------------------------------

// Local expert whose padded segment holds grouped row `row` (tiles never span two experts).
__device__ inline int expert_of_row(const int32_t* offsets, int64_t experts, int64_t row) {
  int lo = 0, hi = int(experts) - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// A: row tile `row_tile` of activations `a`. B: gate|up puts 128 rows of `b0` and of `b1` side
// by side (column tile `col`), down 256 consecutive rows of `b0` (b1 null). A down tile's second
// box may lie wholly past the weights' last row (H an odd multiple of 128 or less): it then
// reloads the last row tile instead, whose columns the epilogue masks, so every stage carries
// the same bytes without relying on fully out-of-range boxes. The backward's tiles take the
// same shapes with MN-major operands.
template <Major MA, Major MB>
__device__ inline TileLoadsOf<MA, MB> tile_loads(const OperandOf<MA>& a, int row_tile, const OperandOf<MB>& b0,
                                                 const std::type_identity_t<OperandOf<MB>>* b1, int col,
                                                 int batch) {
  TileLoadsOf<MA, MB> l;
  l.a = {&a, row_tile, 0};
  if (b1) {
    l.b[0] = {&b0, col, batch};
    l.b[1] = {b1, col, batch};
  } else {
    const int last = (b0.rows - 1) / kHalfN;
    l.b[0] = {&b0, 2 * col, batch};
    l.b[1] = {&b0, min(2 * col + 1, last), batch};
  }
  l.kblocks = (a.k + kTileK - 1) / kTileK;
  return l;
}

// The scheduler thread: the job of an acquired task.
__device__ inline ComputeJob make_job(const MegakernelLaunch& p, const Operands& ops, const core::MegakernelPlan& plan,
                                      const core::Task& t, uint64_t ticket) {
  ComputeJob j;
  j.stop = false;
  j.task = t;
  j.ticket = ticket;
  j.site = {t.kind, t.step < 0 ? -1 : core::minibatch_of_step(plan, t.step), t.row_tile};
  if (t.step >= 0 && !core::task_has_rows(plan, t)) return j;  // beyond the schedule's rows: release only
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, tm = plan.tile_m;
  const int col = int(t.col_tile);
  const int64_t gate_up_col0 = col * plan.tile_n, down_col0 = col * plan.down_tile_n;
  switch (t.kind) {
    case core::TaskKind::shared_gate_up:
      j.loads = tile_loads(ops.x_local, int(t.row_tile), ops.ws_gate, &ops.ws_up, col, 0);
      j.swiglu = true;
      j.out0 = p.shared_gate, j.out1 = p.shared_up, j.out2 = p.shared_hidden;
      j.o = {t.row_tile * tm, p.tokens - t.row_tile * tm, gate_up_col0, Is};
      break;
    case core::TaskKind::shared_down:
      j.loads = tile_loads(ops.shared_hidden, int(t.row_tile), ops.ws_down, nullptr, col, 0);
      j.out0 = p.shared_out;
      j.o = {t.row_tile * tm, p.tokens - t.row_tile * tm, down_col0, H};
      break;
    case core::TaskKind::gate_up:
    case core::TaskKind::down: {
      const int64_t first = core::task_first_row(plan, t), ring = core::ring_row(plan, first);
      const int expert = expert_of_row(p.offsets, p.local_experts, first);
      if (t.kind == core::TaskKind::gate_up) {
        j.loads = tile_loads(ops.ring_x, int(ring / tm), ops.w_gate, &ops.w_up, col, expert);
        j.swiglu = true;
        j.out0 = p.ring_gate, j.out1 = p.ring_up, j.out2 = p.ring_hidden;
        j.o = {ring, tm, gate_up_col0, I};
      } else {
        j.loads = tile_loads(ops.ring_hidden, int(ring / tm), ops.w_down, nullptr, col, expert);
        j.out0 = p.ring_y;
        j.o = {ring, tm, down_col0, H};
      }
      break;
    }
    default: break;
  }
  return j;
}

// ---- Epilogues ------------------------------------------------------------------------------

__device__ inline void store_pair(bf16* base, const TileOut& o, int r, int c, float v0, float v1) {
  if (r >= o.valid_rows || o.col0 + c >= o.width) return;
  *reinterpret_cast<__nv_bfloat162*>(base + (o.row0 + r) * o.width + o.col0 + c) = __floats2bfloat162_rn(v0, v1);
}

__device__ inline float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The consumers: writes a finished tile. Gate is the accumulator's left half, up its right half.
__device__ inline void store_job(const Accumulator& acc, const ComputeJob& j, ActParams act) {
  if (j.swiglu) {
    constexpr int up = kAccumulatorSize / 2;
    for_each_pair<false>([&](int r, int c, int i) {
      const float g0 = round_bf16(acc(i)), g1 = round_bf16(acc(i + 1));
      const float u0 = round_bf16(acc(up + i)), u1 = round_bf16(acc(up + i + 1));
      store_pair(j.out0, j.o, r, c, g0, g1);
      store_pair(j.out1, j.o, r, c, u0, u1);
      store_pair(j.out2, j.o, r, c, core::swiglu_forward<float>(g0, u0, act.clamped, act.limit),
                 core::swiglu_forward<float>(g1, u1, act.clamped, act.limit));
    });
  } else {
    for_each_pair<true>([&](int r, int c, int i) { store_pair(j.out0, j.o, r, c, acc(i), acc(i + 1)); });
  }
  fence_generic_to_async();
}

// ---- Roles ----------------------------------------------------------------------------------

inline constexpr uint32_t kConsumerBarrier = 1;  // named barrier of the 256 consumer threads

__device__ inline uint32_t slot_phase(uint32_t n) { return (n / kTaskSlots) & 1u; }

// The scheduler thread: publishes jobs until the tickets run out or a wait fails, then a stop.
__device__ inline void schedule_tasks(ComputeSmem& sm, const MegakernelLaunch& p, const Operands& ops,
                                      const core::MegakernelPlan& plan, const PipelineWatch& watch) {
  TaskQueue& queue = sm.queue;
  const uint64_t task_count = core::compute_task_count(plan);
  for (uint32_t n = 0;; ++n) {
    const int q = int(n % kTaskSlots);
    bool free = true;
    if (n >= uint32_t(kTaskSlots))
      free = wait_phase(&queue.finished[q], slot_phase(n) ^ 1u, watch, watch.queue_bound_ns,
                        core::PipelineWait::task_finished, TaskSite{});
    ComputeJob job;
    if (free) {
      const uint64_t ticket = atomicAdd(&p.control->compute_ticket, 1ull);
      const core::Task task = ticket < task_count ? core::compute_task(plan, int64_t(ticket)) : core::Task{};
      if (task.kind != core::TaskKind::none && wait_for(p, plan, task)) job = make_job(p, ops, plan, task, ticket);
    }
    queue.jobs[q] = job;
    EmptyBarrier::arrive(&queue.published[q]);  // release (CTA scope): the slot's contents
    if (job.stop) {
      // Observe the last slots' `finished` phases (the readers arrive on them too for the stop).
      for (uint32_t m = n > 0 ? n - 1 : 0; m <= n; ++m)
        wait_phase(&queue.finished[m % kTaskSlots], slot_phase(m), watch, watch.queue_bound_ns,
                   core::PipelineWait::task_finished, TaskSite{});
      return;
    }
  }
}

// The TMA thread: loads each published job's k-blocks.
__device__ inline void load_tasks(ComputeSmem& sm, const PipelineWatch& watch) {
  TaskQueue& queue = sm.queue;
  uint32_t loads = 0;
  for (uint32_t n = 0;; ++n) {
    const int q = int(n % kTaskSlots);
    if (!wait_phase(&queue.published[q], slot_phase(n), watch, watch.queue_bound_ns,
                    core::PipelineWait::task_published, TaskSite{}))
      break;
    const ComputeJob& job = queue.jobs[q];
    const bool stop = job.stop;
    if (!stop) {
      // The scheduler thread acquired the rows' counter; this thread's TMA reads them through
      // the async proxy (its mbarrier wait orders it after that acquire).
      fence_generic_to_async();
      load_tile(sm.tile, loads, job.loads, watch, job.site);
    }
    EmptyBarrier::arrive(&queue.finished[q]);
    if (stop) break;
  }
  drain_tile_pipeline(sm.tile, loads, watch);
}

// The 256 consumer threads: compute and store each published job, then release its counter.
// The leader thread (consumer 0) waits for each job and tells the others through a named
// barrier, so all consumers see the same job or the same stop and reach the same barriers;
// then every consumer acquires the (completed) phase itself before it reads the slot.
__device__ inline void compute_tasks(ComputeSmem& sm, const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                     const PipelineWatch& watch, int cta) {
  __shared__ bool job_ready;
  TaskQueue& queue = sm.queue;
  const bool leader = consumer_thread() == 0;
  uint32_t consumed = 0;
  Accumulator acc;
  for (uint32_t n = 0;; ++n) {
    const int q = int(n % kTaskSlots);
    if (leader)
      job_ready = wait_phase(&queue.published[q], slot_phase(n), watch, watch.queue_bound_ns,
                             core::PipelineWait::task_published, TaskSite{});
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kConsumerBarrier);
    if (!job_ready) return;
    // Complete (the leader saw it): returns at once.
    wait_phase(&queue.published[q], slot_phase(n), watch, watch.queue_bound_ns, core::PipelineWait::task_published,
               TaskSite{});
    const ComputeJob& job = queue.jobs[q];
    if (job.stop) {
      EmptyBarrier::arrive(&queue.finished[q]);
      return;
    }
    const uint64_t start = global_ns();  // the timeline shows work, not waits
    if (job.loads.kblocks > 0) {
      mma_tile(sm.tile, consumed, job.loads.kblocks, acc, watch, job.site);
      store_job(acc, job, p.act);
    }
    // Every consumer's stores (and proxy fence) precede the leader's release.
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kConsumerBarrier);
    if (leader) {
      release_done(p, plan, job.task);
      record(p.timeline_compute, job.ticket, start, cta, job.task);
    }
    EmptyBarrier::arrive(&queue.finished[q]);
  }
}

// A compute CTA: the producer warpgroup gives registers to the consumer warpgroups; warp 0
// loads, warp 1 schedules, warps 2-3 have no work.
// `cta`: its arrival index (the timeline's CTA column).
__device__ inline void run_compute_cta(ComputeSmem& sm, const MegakernelLaunch& p, const Operands& ops,
                                       const core::MegakernelPlan& plan, int cta) {
  init_compute_smem(sm);
  const PipelineWatch watch = make_watch(p.control, p.timeout_ns);
  const int warp = int(threadIdx.x / 32);
  const bool lane0 = threadIdx.x % 32 == 0;
  if (is_consumer()) {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    compute_tasks(sm, p, plan, watch, cta);
  } else {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (warp == 0 && lane0) load_tasks(sm, watch);
    if (warp == 1 && lane0) schedule_tasks(sm, p, ops, plan, watch);
  }
}

}  // namespace moka::cuda::mk
