// The megakernel's compute role: shared-expert and routed expert tiles on the GEMM core
// (tile_gemm.cuh). A gate|up tile computes 128 rows x 128 hidden columns of both gate and
// up (one 128 x 256 accumulator: gate columns left, up columns right, sharing the A tile) and
// applies SwiGLU in its epilogue, writing gate, up and hidden (the saved context of backward;
// gate and up by slot where the context keeps them so, SlotRows); a down tile computes 128 x 256
// of y.
// Numerics match the CUDA layer's (its gate GEMM's SwiGLU epilogue, swiglu_epilogue.cuh, and its
// unfused path alike): gate and up are rounded to bf16 before the activation, which is
// evaluated in fp32 (core/activation.hpp, the CPU reference's function).
//
// Roles of a compute CTA (384 threads), in the style of CUTLASS's sm90 warp-specialized kernels:
// - warp 0 (producer warpgroup): the TMA thread, loading the k-blocks of task after task;
// - warp 1 (producer warpgroup): the scheduler thread, taking compute tickets, waiting on the
//   tasks' counters (acquire + proxy fence) and publishing each task into a two-slot queue in
//   shared memory;
// - warp 2 (producer warpgroup): the store thread, storing the tiles' outputs from shared memory
//   with TMA and releasing each task's counter once its stores completed;
// - warpgroups 1 and 2: the consumers, running the MMAs and the epilogue's arithmetic, which
//   writes the bf16 outputs into two swizzled 128 x 64 shared-memory boxes in turn.
// A queue slot is free again once the TMA thread has issued its task's loads, the consumers
// have finished the task and the store thread has released it, so the scheduler holds at most
// one task beyond the one the consumers run: it acquires task n+1 while task n computes, and the
// TMA thread starts loading task n+1 into the stages task n frees. Taking a ticket only when a
// slot frees keeps the plan's progress argument (core/megakernel_plan.hpp): a CTA holds a later
// task only while it runs an earlier one, which never waits on the later one.
//
// The epilogue overlaps the next task's MMAs: the consumers hand each output box to the store
// thread and start the next task as soon as their last box is in shared memory; the global
// writes, their completion (cp.async.bulk.wait_group 0) and the proxy fence before the counter's
// release run on the store thread meanwhile. The store thread never waits on a counter (only on
// the consumers' boxes and the TMA unit), so the release of task n never waits on task n+1.
#pragma once
#include <cuda_bf16.h>

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "core/activation.hpp"
#include "core/megakernel_plan.hpp"
#include "cuda/megakernel/epilogue_runs.cuh"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/pipeline.cuh"
#include "cuda/megakernel/sync.cuh"
#include "cuda/megakernel/tile_gemm.cuh"

namespace moka::cuda::mk {

// A row-major bf16 output [rows, width] that the store thread writes in 128 x 64 TMA boxes
// (rows and columns past its extents are clipped by the TMA unit).
inline auto make_output_tma(Element* base, int rows, int width) {
  Tensor t = make_tensor(make_gmem_ptr(base), make_shape(rows, width), make_stride(int64_t(width), _1{}));
  return make_tma_atom(SM90_TMA_STORE{}, t, BoxLayout{}, make_shape(Int<kTileM>{}, Int<kTileK>{}));
}

struct Output {
  decltype(make_output_tma(nullptr, 1, 1)) tma;
  int rows = 0, width = 0;
};

inline Output make_output(void* base, int64_t rows, int64_t width) {
  require(width % 8 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0, ErrorCode::unsupported_size,
          "megakernel output of " + std::to_string(rows) + " x " + std::to_string(width) +
              ": TMA stores need the width to be a multiple of 8 and a 16-byte aligned base");
  return {make_output_tma(static_cast<Element*>(base), int(rows), int(width)), int(rows), int(width)};
}

// Descriptors of every operand the compute tiles read and every output they write (kernel
// parameters, __grid_constant__).
struct Operands {
  Operand x_local, ring_x, ring_hidden, shared_hidden;           // activations: [rows, K]
  Operand w_gate, w_up, w_down, ws_gate, ws_up, ws_down;         // weights: [E or 1, N, K]
  Output ring_gate, ring_up, ring_hidden_out, ring_y;            // [ring rows, I] x 3, [ring rows, H]
  Output shared_gate, shared_up, shared_hidden_out, shared_out;  // [tokens, Is] x 3, [tokens, H]
};

// Rows stored by slot: the consumers store the tile's rows from registers, row r to slots[r]
// (none where it is -1, padding), as the backward's dx tiles store d_x. A gate|up tile: a
// resident context's g and u ([slots, I], MegakernelLaunch::gate_by_slot), read by the backward
// only (it unpacks them); gate null: g and u go to the ring as boxes. A down tile at EP = 1: y
// into the combine slots (y_by_slot), read after the kernel only (combine_tokens).
struct SlotRows {
  __nv_bfloat16 *gate = nullptr, *up = nullptr, *y = nullptr;
  const int32_t* slots = nullptr;
  TileOut o{};
};

// One published task: what the TMA thread loads and what the epilogue writes: row tile
// `row_tile` (128 rows) and the 64-column boxes from `col_box` on of the outputs.
struct ComputeJob {
  bool stop = true;  // no task: every role of the CTA leaves
  core::Task task;
  uint64_t ticket = 0;
  TaskSite site;
  TileLoads loads;
  bool swiglu = false;  // gate|up epilogue (out[0..2] = gate, up, hidden), else plain (out[0] = y)
  const Output* out[3] = {nullptr, nullptr, nullptr};
  int outputs = 1;  // out[0..outputs): the boxes stored per 64 columns of the tile
  int row_tile = 0, col_box = 0;
  SlotRows by_slot;  // a gate|up tile of a context saved by slot (out[0] = hidden), a down tile's y
};

using TaskQueue = TaskQueueOf<ComputeJob>;
inline constexpr uint32_t kSlotReaders = 2 + kConsumerThreads;

// The epilogue's hand-off: the consumers write one 128 x 64 bf16 output box (swizzled as a TMA
// box) into buffer n % 2 for their n-th box, the store thread stores it from there. `written`:
// every consumer thread arrives after its writes and proxy fence; `stored`: the store thread
// arrives once the TMA unit has read the buffer (cp.async.bulk.wait_group.read).
inline constexpr int kEpilogueBuffers = 2;
struct EpilogueSync {
  alignas(8) uint64_t written[kEpilogueBuffers];
  alignas(8) uint64_t stored[kEpilogueBuffers];
  uint64_t task_start[kTaskSlots];  // when the consumers started the slot's task (the timeline)
};

struct ComputeSmem {
  TileSmem tile;
  alignas(1024) Element epilogue_box[kEpilogueBuffers][kBoxElements];
  EpilogueSync epilogue;
  TaskQueue queue;  // last: see kComputeSmemBytes
};
// The bytes of ComputeSmem its members use: its size rounds them up to a multiple of its
// 1024-byte alignment, and with the epilogue buffers that padding would not fit an SM.
inline constexpr size_t kComputeSmemBytes = offsetof(ComputeSmem, queue) + sizeof(TaskQueue);
// One CTA per SM within the largest opt-in shared memory of sm_90 (227 KiB), with the 1 KiB the
// kernel may skip to align the dynamic shared memory and a little for its static variables.
static_assert(kComputeSmemBytes + 1024 + 256 <= 232448, "the compute CTA's shared memory must fit one H100/H200 SM");

__device__ inline void init_compute_smem(ComputeSmem& sm) {
  if (threadIdx.x == 0) {
    init_tile_pipeline(sm.tile);
    init_task_queue(sm.queue, kSlotReaders);
    for (int b = 0; b < kEpilogueBuffers; ++b) {
      EmptyBarrier::init(&sm.epilogue.written[b], kConsumerThreads);
      EmptyBarrier::init(&sm.epilogue.stored[b], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  sync(kCtaGroup);
}

// ---- Tasks -> jobs -----------------------------------------------------------------------

// Local expert whose padded segment holds grouped row `row` (tiles never span two experts).
__device__ inline int expert_of_row(const int32_t* offsets, int64_t experts, int64_t row) {
  int lo = 0, hi = int(experts) - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row) lo = mid;
    else hi = mid - 1;
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
                                                 const std::type_identity_t<OperandOf<MB>>* b1, int col, int batch) {
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

inline constexpr int kGateUpOutputs = 3;  // gate, up, hidden

// The scheduler thread: the job of an acquired task, written into its queue slot `j` (a stop
// until then; in place, not through a local copy).
__device__ inline void make_job(ComputeJob& j, const MegakernelLaunch& p, const Operands& ops,
                                const core::MegakernelPlan& plan, const core::Task& t, uint64_t ticket) {
  j.stop = false;
  j.task = t;
  j.ticket = ticket;
  j.site = {t.kind, t.step < 0 ? -1 : core::minibatch_of_step(plan, t.step), t.row_tile};
  if (t.step >= 0 && !core::task_has_rows(plan, t)) return;  // beyond the schedule's rows: release only
  const int64_t tm = plan.tile_m;
  const int col = int(t.col_tile);
  const int gate_up_box = int(col * plan.tile_n / kTileK), down_box = int(col * plan.down_tile_n / kTileK);
  switch (t.kind) {
    case core::TaskKind::shared_gate_up:
      j.loads = tile_loads(ops.x_local, int(t.row_tile), ops.ws_gate, &ops.ws_up, col, 0);
      j.swiglu = true;
      j.out[0] = &ops.shared_gate, j.out[1] = &ops.shared_up, j.out[2] = &ops.shared_hidden_out;
      j.outputs = kGateUpOutputs;
      j.row_tile = int(t.row_tile), j.col_box = gate_up_box;
      break;
    case core::TaskKind::shared_down:
      j.loads = tile_loads(ops.shared_hidden, int(t.row_tile), ops.ws_down, nullptr, col, 0);
      j.out[0] = &ops.shared_out;
      j.row_tile = int(t.row_tile), j.col_box = down_box;
      break;
    case core::TaskKind::gate_up:
    case core::TaskKind::down: {
      const int64_t first = core::task_first_row(plan, t), ring = core::ring_row(plan, first);
      const int expert = expert_of_row(p.offsets, p.local_experts, first);
      j.row_tile = int(ring / tm);
      // Where a tile stores by slot: its rows (fewer at the end of the capacity), columns
      // [col0, col0 + N) of `width`.
      auto slot_out = [&](int64_t col0, int64_t width) {
        return TileOut{first, plan.capacity_rows - first < tm ? plan.capacity_rows - first : tm, col0, width};
      };
      if (t.kind == core::TaskKind::gate_up) {
        j.loads = tile_loads(ops.ring_x, j.row_tile, ops.w_gate, &ops.w_up, col, expert);
        j.swiglu = true;
        j.col_box = gate_up_box;
        if (p.gate_by_slot) {  // resident: the ring row is the grouped row
          j.out[0] = &ops.ring_hidden_out;
          j.by_slot = {p.gate_by_slot, p.up_by_slot, nullptr, p.slot_of_row + first,
                       slot_out(col * plan.tile_n, p.intermediate)};
        } else {
          j.out[0] = &ops.ring_gate, j.out[1] = &ops.ring_up, j.out[2] = &ops.ring_hidden_out;
          j.outputs = kGateUpOutputs;
        }
      } else {
        j.loads = tile_loads(ops.ring_hidden, j.row_tile, ops.w_down, nullptr, col, expert);
        j.col_box = down_box;
        if (p.y_by_slot) {
          j.outputs = 0;
          j.by_slot = {nullptr, nullptr, p.y_by_slot, p.slot_of_row + first,
                       slot_out(col * plan.down_tile_n, p.hidden)};
        } else {
          j.out[0] = &ops.ring_y;
        }
      }
      break;
    }
    default: break;
  }
}

// ---- Epilogue -------------------------------------------------------------------------------

__device__ inline float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// A thread's accumulator elements of one 64-column box: elements [kBoxAccumulators b,
// kBoxAccumulators (b + 1)) hold the tile's columns [64 b, 64 b + 64) (the wgmma layout walks
// its n8 column blocks last).
inline constexpr int kBoxAccumulators = kAccumulatorSize * kTileK / kTileN;
static_assert(AccumulatorToTile{}(0, kBoxAccumulators) == AccumulatorToTile{}(0, 0) + kTileM * kTileK &&
                  AccumulatorToTile{}(3, 2 * kBoxAccumulators - 1) ==
                      AccumulatorToTile{}(3, kBoxAccumulators - 1) + kTileM * kTileK,
              "a 64-column box must be a contiguous run of every thread's accumulator");

// Output boxes of a job: a gate|up tile stores gate, up and hidden (hidden alone where g and u
// go by slot) for each 64-column half of its 128 columns, a down tile the four 64-column boxes
// of its 256 columns.
__device__ inline int box_count(const ComputeJob& j) {
  return j.loads.kblocks == 0 ? 0 : j.outputs * (j.swiglu ? kHalfN : kTileN) / kTileK;
}
__device__ inline const Output& box_output(const ComputeJob& j, int k) { return *j.out[k % j.outputs]; }
__device__ inline int box_column(const ComputeJob& j, int k) { return j.col_box + k / j.outputs; }

// This consumer thread's part of box `Box` of the tile: value(i) (a float2) is the pair of
// accumulator elements (i, i + 1), written as bf16 at its place in the swizzled TMA box.
// The element's address comes from a CuTe tensor over the buffer: the box layout's swizzle
// applies to shared-memory addresses (BoxLayout{}(r, c) alone is the unswizzled offset). The
// stores go through the shared window explicitly (st.shared): the buffer's address comes from
// aligning the dynamic shared memory by integer arithmetic, after which the compiler no longer
// knows it is shared and would emit generic stores.
template <int Box, class Value>
__device__ inline void write_box(Element* box, Value&& value) {
  TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(consumer_thread());
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  Tensor s = make_tensor(make_smem_ptr(box), BoxLayout{});
  CUTE_UNROLL
  for (int k = 0; k < kBoxAccumulators; k += 2) {
    constexpr int first = Box * kBoxAccumulators;
    const auto [r, c] = coords(first + k);
    const float2 v = value(first + k);
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v.x, v.y);
    const uint32_t at = cast_smem_ptr_to_uint(&s(int(r), int(c) - Box * kTileK));
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(reinterpret_cast<const uint32_t&>(pair)) : "memory");
  }
}

// The consumers: hands a finished tile's output boxes to the store thread, each into the next
// epilogue buffer once the TMA unit has read that buffer's previous box (g and u by slot: stores
// them itself, after the hidden boxes). `boxes`: their running box count (the store thread's is
// the same sequence). Gate is the accumulator's left half, up
// its right half; a box's values are the ones the row-major epilogue stored (bf16 gate and up,
// the activation of the rounded values in fp32, then rounded).
__device__ inline void write_job(EpilogueSync& epi, Element (&buffers)[kEpilogueBuffers][kBoxElements], uint32_t& boxes,
                                 const Accumulator& acc, const ComputeJob& j, core::ActParams act,
                                 const PipelineWatch& watch) {
  auto hand_off = [&](auto write) {
    const int b = int(boxes % kEpilogueBuffers);
    if (boxes >= uint32_t(kEpilogueBuffers))
      wait_phase_ordered(&epi.stored[b], (boxes / kEpilogueBuffers - 1) & 1u, watch, watch.stage_bound_ns,
                         core::PipelineWait::box_stored, j.site);
    write(buffers[b]);
    tma_store_fence();  // this thread's shared-memory writes, before the TMA unit reads them
    arrive_ordered(&epi.written[b]);
    ++boxes;
  };
  if (j.swiglu) {
    constexpr int up = kAccumulatorSize / 2;
    auto gate = [&](int i) { return make_float2(round_bf16(acc(i)), round_bf16(acc(i + 1))); };
    auto up_value = [&](int i) { return make_float2(round_bf16(acc(up + i)), round_bf16(acc(up + i + 1))); };
    auto hidden = [&](int i) {
      const float2 g = gate(i), u = up_value(i);
      return make_float2(core::swiglu_forward<float>(g.x, u.x, act.clamped, act.limit),
                         core::swiglu_forward<float>(g.y, u.y, act.clamped, act.limit));
    };
    if (j.by_slot.gate) {  // the store thread starts on hidden while g and u are stored by slot
      [&]<int... Half>(std::integer_sequence<int, Half...>) {
        (hand_off([&](Element* box) { write_box<Half>(box, hidden); }), ...);
      }
      (std::make_integer_sequence<int, kHalfN / kTileK>{});
      store_slot_rows<false>(acc, 0, SlotTargets{j.by_slot.gate}, j.by_slot.slots, j.by_slot.o);
      store_slot_rows<false>(acc, up, SlotTargets{j.by_slot.up}, j.by_slot.slots, j.by_slot.o);
      return;
    }
    [&]<int... Half>(std::integer_sequence<int, Half...>) {
      ((hand_off([&](Element* box) { write_box<Half>(box, gate); }),
        hand_off([&](Element* box) { write_box<Half>(box, up_value); }),
        hand_off([&](Element* box) { write_box<Half>(box, hidden); })),
       ...);
    }
    (std::make_integer_sequence<int, kHalfN / kTileK>{});
  } else if (j.by_slot.y) {
    store_slot_rows<true>(acc, 0, SlotTargets{j.by_slot.y}, j.by_slot.slots, j.by_slot.o);
  } else {
    auto y = [&](int i) { return make_float2(acc(i), acc(i + 1)); };
    [&]<int... Box>(std::integer_sequence<int, Box...>) {
      (hand_off([&](Element* box) { write_box<Box>(box, y); }), ...);
    }
    (std::make_integer_sequence<int, kTileN / kTileK>{});
  }
}

// The store thread: box `col_box` (64 columns) of row tile `row_tile` of `out`, from `box`.
__device__ inline void store_box(const Output& out, const Element* box, int row_tile, int col_box) {
  Tensor m = out.tma.get_tma_tensor(make_shape(out.rows, out.width));
  Tensor g = local_tile(m, Shape<Int<kTileM>, Int<kTileK>>{}, make_coord(row_tile, _));
  Tensor s = make_tensor(make_smem_ptr(box), BoxLayout{});
  auto [tg, ts] = tma_partition(out.tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  copy(out.tma, ts, tg(_, col_box));
}

// The store thread: waits until every bulk store it issued has written global memory.
__device__ inline void wait_stores_complete() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// ---- Roles ----------------------------------------------------------------------------------

__device__ inline void schedule_tasks(ComputeSmem& sm, const MegakernelLaunch& p, const Operands& ops,
                                      const core::MegakernelPlan& plan, const PipelineWatch& watch) {
  const uint64_t task_count = core::compute_task_count(plan);
  schedule_jobs(sm.queue, &p.control->compute_ticket, watch, [&](uint64_t ticket, ComputeJob& job) {
    const core::Task task = ticket < task_count ? core::compute_task(plan, int64_t(ticket)) : core::Task{};
    if (task.kind != core::TaskKind::none && wait_for(p, plan, task)) make_job(job, p, ops, plan, task, ticket);
  });
}

// The TMA thread: loads each published job's k-blocks.
// After a failed wait it issues nothing more (the queue's waits then fail too).
__device__ inline void load_tasks(ComputeSmem& sm, const PipelineWatch& watch) {
  uint32_t loads = 0;
  bool issuing = true;
  producer_jobs(sm.queue, watch, [&](const ComputeJob& job, int) {
    if (issuing) issuing = load_tile(sm.tile, loads, job.loads, watch, job.site);
  });
  drain_tile_pipeline(sm.tile, loads, watch);
}

// The store thread: stores each published job's output boxes as the consumers hand them over,
// then, once the stores completed, releases the job's counter. After a failed wait it stores and
// releases nothing more (every store it issued has completed: it waits for each).
__device__ inline void store_tasks(ComputeSmem& sm, const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                   const PipelineWatch& watch, int cta) {
  EpilogueSync& epi = sm.epilogue;
  uint32_t boxes = 0;
  bool storing = true;
  producer_jobs(sm.queue, watch, [&](const ComputeJob& job, int q) {
    if (!storing) return;
    uint64_t start = global_ns();
    const int count = box_count(job);
    for (int k = 0; k < count; ++k, ++boxes) {
      const int b = int(boxes % kEpilogueBuffers);
      storing = wait_phase_ordered(&epi.written[b], (boxes / kEpilogueBuffers) & 1u, watch, watch.queue_bound_ns,
                                   core::PipelineWait::box_written, job.site);
      if (!storing) return;
      // Read before this box's `stored` arrival, which the leader waits on before it can write
      // the slot's next start (at least two boxes later).
      if (k == 0) start = epi.task_start[q];
      const Output& out = box_output(job, k);
      const int col_box = box_column(job, k);
      if (col_box * kTileK < out.width) store_box(out, sm.epilogue_box[b], job.row_tile, col_box);
      tma_store_arrive();
      tma_store_wait<0>();  // the TMA unit has read the buffer
      arrive_ordered(&epi.stored[b]);
    }
    // The rows are in global memory; the proxy fence orders the TMA's (async-proxy) writes
    // before the release, for the generic and TMA reads of the CTAs that acquire it.
    wait_stores_complete();
    fence_proxy_async_global();
    release_done(p, plan, job.task);
    record(p.timeline_compute, job.ticket, start, cta, job.task);
  });
}

// The forward's consumers: compute each published job and hand its outputs to the store thread.
__device__ inline void compute_tasks(ComputeSmem& sm, const MegakernelLaunch& p, const PipelineWatch& watch) {
  EpilogueSync& epi = sm.epilogue;
  const bool leader = consumer_thread() == 0;
  uint32_t consumed = 0, boxes = 0;
  Accumulator acc;
  consumer_jobs(
      sm.queue, watch,
      [&](const ComputeJob& job, int q) {
        const uint64_t start = global_ns();  // the timeline shows work, not waits
        if (job.loads.kblocks > 0) {
          mma_tile(sm.tile, consumed, job.loads.kblocks, acc, watch, job.site);
          if (leader) epi.task_start[q] = start;  // read by the store thread after the first box
          write_job(epi, sm.epilogue_box, boxes, acc, job, p.act, watch);
        }
      },
      [&] {
        // Observe the last boxes' `stored` phases (the next boxes' waits observe the others).
        for (uint32_t m = boxes > uint32_t(kEpilogueBuffers) ? boxes - kEpilogueBuffers : 0; m < boxes; ++m)
          wait_phase_ordered(&epi.stored[m % kEpilogueBuffers], (m / kEpilogueBuffers) & 1u, watch,
                             watch.stage_bound_ns, core::PipelineWait::box_stored, TaskSite{});
      });
}

// A compute CTA: the producer warpgroup gives registers to the consumer warpgroups; warp 0
// loads, warp 1 schedules, warp 2 stores, warp 3 has no work.
// `cta`: its arrival index (the timeline's CTA column).
__device__ inline void run_compute_cta(ComputeSmem& sm, const MegakernelLaunch& p, const Operands& ops,
                                       const core::MegakernelPlan& plan, int cta) {
  init_compute_smem(sm);
  const PipelineWatch watch = make_watch(p.control, p.timeout_ns);
  const int warp = int(threadIdx.x / 32);
  const bool lane0 = threadIdx.x % 32 == 0;
  if (is_consumer()) {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    compute_tasks(sm, p, watch);
  } else {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (warp == 0 && lane0) load_tasks(sm, watch);
    if (warp == 1 && lane0) schedule_tasks(sm, p, ops, plan, watch);
    if (warp == 2 && lane0) store_tasks(sm, p, plan, watch, cta);
  }
}

}  // namespace moka::cuda::mk
