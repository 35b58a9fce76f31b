// The persistent backward megakernel (docs/MEGAKERNEL.md, "The backward on the GPU"): grid =
// one CTA per SM; the first num_comm_ctas CTAs to arrive pull and push rows, the others run the
// compute tiles on the GEMM core. Both roles take the plan's tickets in order
// (core/megakernel_backward_plan.hpp: compute_task, comm_task) and wait only on the counters
// task_wait names, which the plan's progress argument shows are released by tasks that can
// always run, for any routing and CTA split. Every wait is bounded and reports into the status
// word; a failure ends every CTA.
//
// Compute CTAs have the forward's roles (forward_compute.cuh): a scheduler thread takes tickets,
// waits and publishes jobs into a two-slot queue, a TMA thread loads their k-blocks, two
// consumer warpgroups run the MMAs and the epilogue and release the task's counters. A job holds
// up to two products of one operand layout:
//   (shared_)gate_up  x . [W_gate | W_up] (K, K)        replay: g, u again (the forward's tile)
//   shared_dgd, dgd   d_out . W_down (K, MN)            store_dgd_tile (SwiGLU backward)
//   shared_dx, dx     dg . W_gate + du . W_up (K, MN)   bf16 rows of d_x
//   wgrad gate|up     x^T . [dg | du] (MN, MN)          dW_gate, dW_up stored transposed
//   wgrad down        d_out^T . hs (MN, MN)             dW_down
// A weight-gradient tile whose expert continues from the previous macrobatch starts from that
// segment's fp32 carry; one that continues into the next leaves its accumulator there.
#include "cuda/common/check.hpp"
#include "cuda/megakernel/backward.hpp"
#include "cuda/megakernel/backward_epilogue.cuh"
#include "cuda/megakernel/comm.cuh"
#include "cuda/megakernel/forward_compute.cuh"
#include "cuda/megakernel/sync.cuh"

namespace moka::cuda {
namespace mk {
namespace {

using core::BackwardCounterKind;
using core::BackwardTask;
using core::BackwardTaskKind;
using core::MegakernelBackwardPlan;
using core::SegmentTable;
using MnOperand = OperandOf<Major::MN>;

// Descriptors of every operand (kernel parameters). Ring and shared rows are read both ways:
// K-major as A of dx (K = I), MN-major as operands of the weight gradients (K = rows).
struct BackwardOperands {
  Operand d_out_local, ring_d_out, ring_dg, ring_du, shared_dg, shared_du;
  Operand x_local, ring_x, w_gate_k, w_up_k, ws_gate_k, ws_up_k;  // replay: the forward's gate|up tile
  MnOperand w_down, w_gate, w_up, ws_down, ws_gate, ws_up;
  MnOperand x_local_t, d_out_local_t, shared_dg_t, shared_du_t, shared_hs_t;
  MnOperand ring_x_t, ring_d_out_t, ring_dg_t, ring_du_t, ring_hs_t;
};

struct BackwardParams {
  MegakernelBackwardLaunch launch;
  BackwardOperands ops;
};

// ---- Waits and releases -----------------------------------------------------------------------

__device__ inline bool wait_task(const MegakernelBackwardLaunch& p, const MegakernelBackwardPlan& plan,
                                 const SegmentTable& segments, const BackwardTask& task) {
  MegakernelControl* control = &p.control->base;
  const core::BackwardCounterRef need = core::task_wait(plan, segments, task);
  if (need.kind == BackwardCounterKind::none) return !failed(control);
  int64_t seen = 0;
  const WaitOutcome outcome = wait_counter(p.counters + core::counter_index(plan, need.kind, need.at), need.target,
                                           control, p.timeout_ns, seen);
  if (outcome == WaitOutcome::timed_out) {
    core::MegakernelStatus s;
    s.code = core::StatusCode::timeout;
    s.target = need.target;
    s.observed = seen;
    report(control, s, [&] {
      p.control->wait = {task.kind,    need.kind, task.step,   task.row_tile, task.col_tile,
                         task.segment, need.at,   need.target, seen};
    });
  }
  return outcome == WaitOutcome::reached;
}

// One thread, after the barrier that ends the task for every thread that stored its outputs.
__device__ inline void release_task(const MegakernelBackwardLaunch& p, const MegakernelBackwardPlan& plan,
                                    const SegmentTable& segments, const BackwardTask& task) {
  for (const core::BackwardCounterRange& r : core::task_releases(plan, segments, task).range)
    for (int64_t at = r.first; at <= r.last && r.kind != BackwardCounterKind::none; ++at)
      atomic_add<MemoryOrder::release, Scope::gpu, 1>(p.counters + core::counter_index(plan, r.kind, at));
}

// ---- Comm: pull and push ------------------------------------------------------------------------

// Where a grouped row comes from: its origin rank and the slot token*k + j there (-1: padding).
struct Origin {
  int64_t rank = -1, slot = -1;
};
__device__ inline Origin origin_of(const MegakernelBackwardLaunch& p, int64_t row) {
  const int32_t slot = p.io.slot_of_row[row];
  if (slot < 0) return {};
  const int64_t per_rank = p.tokens * p.top_k;
  return {slot / per_rank, slot % per_rank};
}

// Pull: each row's d_out (from its origin rank) and x (the forward's grouped row where the
// resident context has it, else from its origin rank too) into the ring, and its route weight;
// padding rows get zeros.
__device__ inline void pull_block(const MegakernelBackwardLaunch& p, const MegakernelBackwardPlan& plan,
                                  const BackwardTask& task) {
  __shared__ const int4* src[2 * kTileM];
  __shared__ int4* dst[2 * kTileM];
  const int64_t H = p.hidden, first = core::task_first_row(plan, task);
  const bool replay = plan.mode == core::ContextMode::replay;
  for (int64_t r = threadIdx.x; r < plan.tile_m; r += blockDim.x) {
    const int64_t row = first + r, ring = core::ring_row(plan, row);
    const Origin o = origin_of(p, row);
    const bool real = o.rank >= 0;
    src[r] = real ? reinterpret_cast<const int4*>(p.io.d_out_peers[o.rank] + o.slot / p.top_k * H) : nullptr;
    dst[r] = reinterpret_cast<int4*>(p.ring_d_out + ring * H);
    const bf16* x = nullptr;
    if (real) x = replay || !p.io.context_x ? p.io.x_peers[o.rank] + o.slot / p.top_k * H : p.io.context_x + row * H;
    src[kTileM + r] = reinterpret_cast<const int4*>(x);
    dst[kTileM + r] = reinterpret_cast<int4*>(p.ring_x + ring * H);
    p.ring_weight[ring] = real ? p.io.weight_peers[o.rank][o.slot] : 0.f;
  }
  sync(kCtaGroup);
  copy_rows(src, dst, 2 * kTileM, int(H / 8));
  // The ring rows are read next by TMA (async proxy) in the dgd and weight-gradient tiles.
  fence_proxy_async_global();
}

// Push: each row's d_x into its origin slot (unless the dx tiles stored it there: dx_into_slots),
// and its d_topk_weights entry: the row's per-column-tile partials of <dH, h> summed in column
// order.
__device__ inline void push_block(const MegakernelBackwardLaunch& p, const MegakernelBackwardPlan& plan,
                                  const BackwardTask& task) {
  __shared__ const int4* src[kTileM];
  __shared__ int4* dst[kTileM];
  const int64_t H = p.hidden, first = core::task_first_row(plan, task);
  for (int64_t r = threadIdx.x; r < plan.tile_m; r += blockDim.x) {
    const int64_t row = first + r, ring = core::ring_row(plan, row);
    const Origin o = origin_of(p, row);
    src[r] = nullptr;
    dst[r] = nullptr;
    if (o.rank < 0) continue;
    if (!p.io.dx_into_slots) {
      src[r] = reinterpret_cast<const int4*>(p.ring_dx + ring * H);
      dst[r] = reinterpret_cast<int4*>(p.io.dx_slot_peers[o.rank] + o.slot * H);
    }
    const float* partials = p.ring_partials + ring * plan.dgd_col_tiles;
    float d_weight = partials[0];
    for (int64_t c = 1; c < plan.dgd_col_tiles; ++c) d_weight = __fadd_rn(d_weight, partials[c]);
    p.io.dw_slot_peers[o.rank][o.slot] = d_weight;
  }
  sync(kCtaGroup);
  copy_rows(src, dst, kTileM, int(H / 8));
}

// The comm CTA: thread 0 takes a ticket and waits; the CTA copies; thread 0 releases.
__device__ inline void run_comm_cta(const MegakernelBackwardLaunch& p, const MegakernelBackwardPlan& plan,
                                    const SegmentTable& segments) {
  __shared__ BackwardTask shared_task;
  __shared__ bool proceed;
  const uint64_t count = core::comm_task_count(plan);
  for (;;) {
    if (threadIdx.x == 0) {
      const uint64_t t = atomic_fetch_add<MemoryOrder::relaxed, Scope::gpu>(&p.control->base.comm_ticket, 1ull);
      shared_task = t < count ? core::comm_task(plan, int64_t(t)) : BackwardTask{};
      proceed = shared_task.kind != BackwardTaskKind::none && wait_task(p, plan, segments, shared_task);
    }
    sync(kCtaGroup);
    if (!proceed) return;
    const BackwardTask task = shared_task;
    if (core::task_has_rows(plan, task)) {
      if (task.kind == BackwardTaskKind::pull) {
        pull_block(p, plan, task);
      } else {
        push_block(p, plan, task);
      }
    }
    sync(kCtaGroup);
    if (threadIdx.x == 0) release_task(p, plan, segments, task);
  }
}

// ---- Compute: tasks -> jobs -------------------------------------------------------------------

enum class JobLayout : int32_t { k_k, k_mn, mn_mn };
enum class JobStore : int32_t { none, gate_up, dgd, rows, slot_rows, weight_pair, weight_down };

// One published task: what the TMA thread loads (up to two products of one layout) and what the
// consumers' epilogue writes.
struct BackwardJob {
  bool stop = true;  // no task: every role of the CTA leaves
  BackwardTask task;
  TaskSite site;
  JobLayout layout = JobLayout::k_mn;
  int products = 0;  // 0: nothing to compute (a task beyond the schedule's rows): release only
  TileLoads k_k;
  TileLoadsOf<Major::K, Major::MN> k_mn[2];
  TileLoadsOf<Major::MN, Major::MN> mn_mn;
  JobStore store = JobStore::none;
  DgdTile dgd;
  // rows, weight_down: out0; weight_pair: dW_gate, dW_up; gate_up: g, u
  bf16 *out0 = nullptr, *out1 = nullptr;
  const int32_t* row_slots = nullptr;  // slot_rows: the slot of each of the tile's rows (-1: padding)
  SlotTargets slot_rows;               // slot_rows: d_x's slot 0 into d_x, the others into the d_x slots
  TileOut o{};                         // weight_pair: row0 = H row, col0 = I column, width = I, rows H
  const float* carry_in = nullptr;     // start from this carry (continue_acc)
  float* carry_out = nullptr;          // leave the accumulator here instead of storing
  TileOut carry_o{};
};

__device__ inline int kblocks_of(const BackwardJob& j) {
  if (j.layout == JobLayout::k_k) return j.products > 0 ? j.k_k.kblocks : 0;
  if (j.layout == JobLayout::mn_mn) return j.products > 0 ? j.mn_mn.kblocks : 0;
  int n = 0;
  for (int q = 0; q < j.products; ++q) n += j.k_mn[q].kblocks;
  return n;
}

__device__ inline DgdTile dgd_tile(const bf16* gate, const bf16* up, const float* weight, bf16* dg, bf16* du, bf16* hs,
                                   float* partials, int64_t row0, int64_t valid_rows, int64_t col, int64_t width,
                                   int64_t col_tiles, core::ActParams act) {
  return {gate, up, weight, dg, du, hs, partials, row0, valid_rows, col * kTileN, width, col, col_tiles, act};
}

// A weight-gradient tile `tile` of an expert (gate|up pairs first, then down tiles), over K =
// k-blocks [kblock0, kblock0 + kblocks) of its row operands. Carries: the pair tiles' carry is
// [H, 2 * I rounded up to 128] (column tile c = 128 gate columns, then 128 up), dW_down's [H, I]
// after it.
struct WeightGradOperands {
  const MnOperand *x, *dg, *du, *d_out, *hs;
  bf16 *d_gate, *d_up, *d_down;
  int64_t intermediate;
};
__device__ inline void weight_grad_job(BackwardJob& j, const MegakernelBackwardLaunch& p, const WeightGradOperands& w,
                                       int64_t tile, int64_t gate_up_tiles, int kblock0, int kblocks,
                                       const float* carry_in, float* carry_out) {
  const int64_t H = p.hidden, I = w.intermediate, h_tiles = core::ceil_div(H, kTileM);
  const int64_t pair_width = 2 * core::ceil_div(I, kHalfN) * kHalfN;
  j.layout = JobLayout::mn_mn;
  j.products = 1;
  int64_t carry_offset = 0;
  if (tile < gate_up_tiles) {
    const int64_t h_tile = tile % h_tiles, i_tile = tile / h_tiles;
    j.mn_mn = tile_loads(*w.x, int(h_tile), *w.dg, w.du, int(i_tile), 0);
    j.store = JobStore::weight_pair;
    j.out0 = w.d_gate;
    j.out1 = w.d_up;
    j.o = {h_tile * kTileM, H, i_tile * kHalfN, I};
    j.carry_o = {h_tile * kTileM, H - h_tile * kTileM, i_tile * kTileN, pair_width};
  } else {
    tile -= gate_up_tiles;
    const int64_t h_tile = tile % h_tiles, i_tile = tile / h_tiles;
    j.mn_mn = tile_loads(*w.d_out, int(h_tile), *w.hs, nullptr, int(i_tile), 0);
    j.store = JobStore::weight_down;
    j.out0 = w.d_down;
    j.o = {h_tile * kTileM, H - h_tile * kTileM, i_tile * kTileN, I};
    j.carry_o = j.o;
    carry_offset = H * pair_width;
  }
  j.mn_mn.kblock0 = kblock0;
  j.mn_mn.kblocks = kblocks;
  j.carry_in = carry_in ? carry_in + carry_offset : nullptr;
  j.carry_out = carry_out ? carry_out + carry_offset : nullptr;
}

// The scheduler thread: the job of an acquired task, written into its queue slot `j` (a stop
// until then). In place: a job built as a value went through local memory on its way to the
// slot (a few hundred local accesses per task on the 40-register scheduler thread).
__device__ inline void make_job(BackwardJob& j, const MegakernelBackwardLaunch& p, const BackwardOperands& ops,
                                const MegakernelBackwardPlan& plan, const SegmentTable& segments,
                                const BackwardTask& t) {
  j.stop = false;
  j.task = t;
  j.site = {core::TaskKind::none, t.step, t.row_tile};
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, T = p.tokens, tm = plan.tile_m;
  const int col = int(t.col_tile);
  const bool replay = plan.mode == core::ContextMode::replay;
  switch (t.kind) {
    case BackwardTaskKind::shared_gate_up:
      j.layout = JobLayout::k_k;
      j.products = 1;
      j.k_k = tile_loads(ops.x_local, int(t.row_tile), ops.ws_gate_k, &ops.ws_up_k, col, 0);
      j.store = JobStore::gate_up;
      j.out0 = p.recomputed_shared_gate;
      j.out1 = p.recomputed_shared_up;
      j.o = {t.row_tile * tm, T - t.row_tile * tm, int64_t(col) * kHalfN, Is};
      break;
    case BackwardTaskKind::shared_dgd:
      j.products = 1;
      j.k_mn[0] = tile_loads(ops.d_out_local, int(t.row_tile), ops.ws_down, nullptr, col, 0);
      j.store = JobStore::dgd;
      j.dgd =
          dgd_tile(replay ? p.recomputed_shared_gate : p.io.shared_gate,
                   replay ? p.recomputed_shared_up : p.io.shared_up, p.ones, p.shared_dg, p.shared_du, p.shared_hs,
                   p.shared_partials, t.row_tile * tm, T - t.row_tile * tm, col, Is, plan.shared_dgd_col_tiles, p.act);
      break;
    case BackwardTaskKind::shared_dx:
      j.products = 2;
      j.k_mn[0] = tile_loads(ops.shared_dg, int(t.row_tile), ops.ws_gate, nullptr, col, 0);
      j.k_mn[1] = tile_loads(ops.shared_du, int(t.row_tile), ops.ws_up, nullptr, col, 0);
      j.store = JobStore::rows;
      j.out0 = p.shared_dx;
      j.o = {t.row_tile * tm, T - t.row_tile * tm, int64_t(col) * kTileN, H};
      break;
    case BackwardTaskKind::shared_wgrad:
      weight_grad_job(j, p,
                      {&ops.x_local_t, &ops.shared_dg_t, &ops.shared_du_t, &ops.d_out_local_t, &ops.shared_hs_t,
                       p.io.d_ws_gate, p.io.d_ws_up, p.io.d_ws_down, Is},
                      t.col_tile, plan.shared_wgrad_gate_up_tiles, 0, int(core::ceil_div(T, kTileK)), nullptr, nullptr);
      break;
    case BackwardTaskKind::gate_up:
    case BackwardTaskKind::dgd:
    case BackwardTaskKind::dx: {
      if (!core::task_has_rows(plan, t)) break;  // beyond the schedule's rows: release only
      const int64_t first = core::task_first_row(plan, t), ring = core::ring_row(plan, first);
      const int expert = expert_of_row(p.io.offsets, p.local_experts, first);
      if (t.kind == BackwardTaskKind::gate_up) {
        j.layout = JobLayout::k_k;
        j.products = 1;
        j.k_k = tile_loads(ops.ring_x, int(ring / tm), ops.w_gate_k, &ops.w_up_k, col, expert);
        j.store = JobStore::gate_up;
        j.out0 = p.ring_gate;
        j.out1 = p.ring_up;
        j.o = {ring, tm, int64_t(col) * kHalfN, I};
      } else if (t.kind == BackwardTaskKind::dgd) {
        j.products = 1;
        j.k_mn[0] = tile_loads(ops.ring_d_out, int(ring / tm), ops.w_down, nullptr, col, expert);
        j.store = JobStore::dgd;
        // Resident: g and u are the forward's grouped rows, offset so that ring row r reads
        // grouped row first + (r - ring). Replay: the ring's recomputed rows.
        const int64_t shift = (first - ring) * I;
        const bf16* gate = replay ? p.ring_gate : p.io.context_gate + shift;
        const bf16* up = replay ? p.ring_up : p.io.context_up + shift;
        j.dgd = dgd_tile(gate, up, p.ring_weight, p.ring_dg, p.ring_du, p.ring_hs, p.ring_partials, ring, tm, col, I,
                         plan.dgd_col_tiles, p.act);
      } else {
        j.products = 2;
        j.k_mn[0] = tile_loads(ops.ring_dg, int(ring / tm), ops.w_gate, nullptr, col, expert);
        j.k_mn[1] = tile_loads(ops.ring_du, int(ring / tm), ops.w_up, nullptr, col, expert);
        if (p.io.dx_into_slots) {  // EP = 1: each row's d_x straight into its slot
          j.store = JobStore::slot_rows;
          j.slot_rows = {const_cast<bf16*>(p.io.dx_slots), p.io.d_x, int32_t(p.top_k)};
          j.row_slots = p.io.slot_of_row + first;
          j.o = {0, tm, int64_t(col) * kTileN, H};
        } else {
          j.store = JobStore::rows;
          j.out0 = p.ring_dx;
          j.o = {ring, tm, int64_t(col) * kTileN, H};
        }
      }
      break;
    }
    case BackwardTaskKind::wgrad: {
      const core::WeightGradSegment& g = segments.segments[t.segment];
      const int64_t first = g.first_tile * tm, e = g.expert;
      const float* carry_in = nullptr;
      float* carry_out = nullptr;
      const int64_t carry = backward_carry_floats(H, I);
      if (g.carry_in) carry_in = p.carries + (core::macrobatch_of_tile(plan, g.first_tile) - 1) * carry;
      if (g.carry_out) carry_out = p.carries + core::macrobatch_of_tile(plan, g.last_tile) * carry;
      weight_grad_job(j, p,
                      {&ops.ring_x_t, &ops.ring_dg_t, &ops.ring_du_t, &ops.ring_d_out_t, &ops.ring_hs_t,
                       p.io.d_w_gate + e * I * H, p.io.d_w_up + e * I * H, p.io.d_w_down + e * H * I, I},
                      t.col_tile, plan.wgrad_gate_up_tiles, int(core::ring_row(plan, first) / kTileK),
                      int((g.last_tile - g.first_tile + 1) * tm / kTileK), carry_in, carry_out);
      break;
    }
    default: break;
  }
}

// ---- Compute: roles ------------------------------------------------------------------------

// The forward's task queue with the backward's jobs. The readers that arrive on `finished`: the
// TMA thread and every consumer; the backward's consumers store their tiles from registers and
// release the counters themselves, so it has no store thread (the forward's kSlotReaders
// counts one).
using BackwardQueue = TaskQueueOf<BackwardJob>;
inline constexpr uint32_t kBackwardSlotReaders = 1 + kConsumerThreads;

struct BackwardSmem {
  TileSmem tile;
  BackwardQueue queue;
};

__device__ inline void init_backward_smem(BackwardSmem& sm) {
  if (threadIdx.x == 0) {
    init_tile_pipeline(sm.tile);
    init_task_queue(sm.queue, kBackwardSlotReaders);
    cutlass::arch::fence_barrier_init();
  }
  sync(kCtaGroup);
}

// The scheduler thread (pipeline.cuh's loop): it takes a ticket only once a queue slot is free
// (the plan's progress argument: a CTA holds a later task only while it runs an earlier one).
__device__ inline void schedule_backward(BackwardSmem& sm, const MegakernelBackwardLaunch& p,
                                         const BackwardOperands& ops, const MegakernelBackwardPlan& plan,
                                         const SegmentTable& segments, const PipelineWatch& watch) {
  const uint64_t task_count = core::compute_task_count(plan, segments);
  schedule_jobs(sm.queue, &p.control->base.compute_ticket, watch, [&](uint64_t ticket, BackwardJob& job) {
    const BackwardTask task =
        ticket < task_count ? core::compute_task(plan, segments, int64_t(ticket)) : BackwardTask{};
    if (task.kind != BackwardTaskKind::none && wait_task(p, plan, segments, task))
      make_job(job, p, ops, plan, segments, task);
  });
}

// The TMA thread: loads each published job's products, one after another.
// After a failed wait it issues nothing more (the queue's waits then fail too).
__device__ inline void load_backward(BackwardSmem& sm, const PipelineWatch& watch) {
  uint32_t loads = 0;
  bool issuing = true;
  producer_jobs(sm.queue, watch, [&](const BackwardJob& job, int) {
    if (!issuing) return;
    if (job.layout == JobLayout::k_k) {
      if (job.products > 0) issuing = load_tile(sm.tile, loads, job.k_k, watch, job.site);
    } else if (job.layout == JobLayout::mn_mn) {
      if (job.products > 0) issuing = load_tile(sm.tile, loads, job.mn_mn, watch, job.site);
    } else {
      for (int i = 0; i < job.products && issuing; ++i)
        issuing = load_tile(sm.tile, loads, job.k_mn[i], watch, job.site);
      if (job.store == JobStore::dgd) prefetch_dgd_inputs(job.dgd);
    }
  });
  drain_tile_pipeline(sm.tile, loads, watch);
}

// The consumers' epilogue of one job. Inlined: as a call it takes the accumulator through local
// memory, and ptxas then serializes the wgmma instructions.
__device__ __forceinline__ void store_backward_job(const Accumulator& acc, const BackwardJob& j) {
  if (j.carry_out) {
    store_carry(acc, j.carry_out, j.carry_o);
    return;
  }
  switch (j.store) {
    case JobStore::gate_up:
      // The forward's g and u: the fp32 accumulator rounded to bf16 (gate left, up right).
      store_rows<false>(acc, 0, j.out0, j.o);
      store_rows<false>(acc, kAccumulatorSize / 2, j.out1, j.o);
      fence_proxy_async_global();
      break;
    case JobStore::dgd: store_dgd_tile(acc, j.dgd); break;
    case JobStore::rows:
    case JobStore::weight_down:
      store_rows<true>(acc, 0, j.out0, j.o);
      // Ring rows of d_x are read by the push (generic); the fence keeps every store path alike.
      fence_proxy_async_global();
      break;
    case JobStore::slot_rows:
      store_slot_rows<true>(acc, 0, j.slot_rows, j.row_slots, j.o);
      fence_proxy_async_global();
      break;
    case JobStore::weight_pair:
      store_transposed_halves(acc, j.out0, j.out1, j.o.row0, j.o.col0, j.o.valid_rows, j.o.width);
      break;
    case JobStore::none: break;
  }
}

// The 256 consumer threads: compute and store each published job, then release its counters.
__device__ __forceinline__ void compute_backward(BackwardSmem& sm, const MegakernelBackwardLaunch& p,
                                                 const MegakernelBackwardPlan& plan, const SegmentTable& segments,
                                                 const PipelineWatch& watch) {
  const bool leader = consumer_thread() == 0;
  uint32_t consumed = 0;
  Accumulator acc;
  // The job's lambda is forced inline as store_backward_job is: left as a call, it takes the
  // accumulator through local memory.
  consumer_jobs(
      sm.queue, watch,
      [&](const BackwardJob& job, int) __attribute__((always_inline)) {
        if (job.products > 0) {
          const int kblocks = kblocks_of(job);
          const bool carried = job.carry_in != nullptr;
          if (carried) load_carry(acc, job.carry_in, job.carry_o);
          if (job.layout == JobLayout::k_k) {
            mma_tile<Major::K, Major::K>(sm.tile, consumed, kblocks, acc, watch, job.site);
          } else if (job.layout == JobLayout::mn_mn) {
            mma_tile<Major::MN, Major::MN>(sm.tile, consumed, kblocks, acc, watch, job.site, carried);
          } else {
            mma_tile<Major::K, Major::MN>(sm.tile, consumed, kblocks, acc, watch, job.site, carried);
          }
          store_backward_job(acc, job);
        }
        // Every consumer's stores (and proxy fence) precede the leader's release; the ordered
        // barrier keeps the compiler from sinking a store below it.
        sync(kConsumerGroup);
        if (leader) release_task(p, plan, segments, job.task);
      },
      [] {});
}

// Inlined into the kernel: a call between the wgmma instructions and their waits makes ptxas
// serialize every wgmma.
__device__ __forceinline__ void run_compute_cta(BackwardSmem& sm, const MegakernelBackwardLaunch& p,
                                                const BackwardOperands& ops, const MegakernelBackwardPlan& plan,
                                                const SegmentTable& segments) {
  init_backward_smem(sm);
  const PipelineWatch watch = make_watch(&p.control->base, p.timeout_ns);
  const int warp = int(threadIdx.x / 32);
  const bool lane0 = threadIdx.x % 32 == 0;
  if (is_consumer()) {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    compute_backward(sm, p, plan, segments, watch);
  } else {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (warp == 0 && lane0) load_backward(sm, watch);
    if (warp == 1 && lane0) schedule_backward(sm, p, ops, plan, segments, watch);
  }
}

// ---- Kernels ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, 1) backward_megakernel(const __grid_constant__ BackwardParams params) {
  const MegakernelBackwardLaunch& p = params.launch;
  const int cta = arrival_index(&p.control->base);
  if (cta < 0) return;  // the schedule already failed (capacity)
  const MegakernelBackwardPlan plan = core::backward_trim_to_rows(p.plan, p.io.offsets[p.local_experts]);
  const SegmentTable segments{p.segments, p.first_of_step};
  if (cta < p.num_comm_ctas) {
    run_comm_cta(p, plan, segments);
    return;
  }
  extern __shared__ char smem_raw[];
  // The swizzled operand tiles need 1024-byte alignment.
  auto* smem = reinterpret_cast<BackwardSmem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  run_compute_cta(*smem, p, params.ops, plan, segments);
}

BackwardOperands make_operands(const MegakernelBackwardLaunch& p) {
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, E = p.local_experts, T = p.tokens;
  const int64_t ring = p.plan.ring_rows, shared_rows = p.plan.shared_row_tiles * p.plan.tile_m;
  BackwardOperands o;
  o.ring_d_out = make_operand(p.ring_d_out, ring, H, 1);
  const bool replay = p.plan.mode == core::ContextMode::replay;
  if (replay) {
    o.ring_x = make_operand(p.ring_x, ring, H, 1);
    o.w_gate_k = make_operand(p.io.w_gate, I, H, E);
    o.w_up_k = make_operand(p.io.w_up, I, H, E);
  }
  o.ring_dg = make_operand(p.ring_dg, ring, I, 1);
  o.ring_du = make_operand(p.ring_du, ring, I, 1);
  o.w_down = make_operand<Major::MN>(p.io.w_down, I, H, E);
  o.w_gate = make_operand<Major::MN>(p.io.w_gate, H, I, E);
  o.w_up = make_operand<Major::MN>(p.io.w_up, H, I, E);
  o.ring_x_t = make_operand<Major::MN>(p.ring_x, H, ring, 1);
  o.ring_d_out_t = make_operand<Major::MN>(p.ring_d_out, H, ring, 1);
  o.ring_dg_t = make_operand<Major::MN>(p.ring_dg, I, ring, 1);
  o.ring_du_t = make_operand<Major::MN>(p.ring_du, I, ring, 1);
  o.ring_hs_t = make_operand<Major::MN>(p.ring_hs, I, ring, 1);
  if (Is > 0) {
    o.d_out_local = make_operand(p.io.d_out, T, H, 1);
    o.shared_dg = make_operand(p.shared_dg, shared_rows, Is, 1);
    o.shared_du = make_operand(p.shared_du, shared_rows, Is, 1);
    o.ws_down = make_operand<Major::MN>(p.io.ws_down, Is, H, 1);
    o.ws_gate = make_operand<Major::MN>(p.io.ws_gate, H, Is, 1);
    o.ws_up = make_operand<Major::MN>(p.io.ws_up, H, Is, 1);
    if (replay) {
      o.x_local = make_operand(p.io.x, T, H, 1);
      o.ws_gate_k = make_operand(p.io.ws_gate, Is, H, 1);
      o.ws_up_k = make_operand(p.io.ws_up, Is, H, 1);
    }
    // K = the T tokens: the rows past T (the last tile's padding) are zero-filled by the TMA.
    o.x_local_t = make_operand<Major::MN>(p.io.x, H, T, 1);
    o.d_out_local_t = make_operand<Major::MN>(p.io.d_out, H, T, 1);
    o.shared_dg_t = make_operand<Major::MN>(p.shared_dg, Is, T, 1);
    o.shared_du_t = make_operand<Major::MN>(p.shared_du, Is, T, 1);
    o.shared_hs_t = make_operand<Major::MN>(p.shared_hs, Is, T, 1);
  }
  return o;
}

}  // namespace
}  // namespace mk

size_t megakernel_backward_smem_bytes() { return sizeof(mk::BackwardSmem) + 1024; }

int megakernel_backward_ctas_per_sm() {
  const int smem = int(megakernel_backward_smem_bytes());
  MOKA_CUDA_CHECK(cudaFuncSetAttribute(mk::backward_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int ctas = 0;
  MOKA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, mk::backward_megakernel, mk::kThreads, smem));
  return ctas;
}

void load_megakernel_backward_kernels() {
  load_backward_edge_kernels();
  cudaFuncAttributes attributes;
  MOKA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, mk::backward_megakernel));
}

void launch_megakernel_backward(const MegakernelBackwardLaunch& launch, cudaStream_t stream) {
  static_assert(sizeof(mk::BackwardParams) <= 32764, "kernel parameters must fit the 32 KiB limit");
  const mk::BackwardParams params{launch, mk::make_operands(launch)};
  launch_backward_segments(launch, stream);
  mk::launch_cooperative(mk::backward_megakernel, params, launch.num_ctas, mk::kThreads,
                         megakernel_backward_smem_bytes(), stream);
}

}  // namespace moka::cuda
