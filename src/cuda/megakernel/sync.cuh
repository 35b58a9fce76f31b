// Synchronization of the megakernel's CTAs: task tickets, dependency counters (release adds,
// bounded acquire waits), the first-failure status word and the task timeline, on the primitives
// of memory_order.cuh (each names its memory order, scope or thread group). Every counter is
// GPU-local; the only cross-GPU traffic inside the kernel is data (docs/MEGAKERNEL.md).
#pragma once
#include <cstdint>

#include "core/megakernel_plan.hpp"
#include "cuda/common/check.hpp"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/memory_order.cuh"

namespace moka::cuda::mk {

inline constexpr unsigned kMaxBackoffNs = 256;  // longest sleep between two counter polls

__device__ inline uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The status word's code, written by report() (a relaxed system-scope store after a seq_cst
// fence) and read here relaxed at system scope, as often as a waiting thread polls.
__device__ inline bool failed(const MegakernelControl* control) {
  return atomic_load<MemoryOrder::relaxed, Scope::sys>(reinterpret_cast<const int32_t*>(&control->status.code)) !=
         static_cast<int32_t>(core::StatusCode::ok);
}

// First failure wins; the code is published last so a reader of a non-ok code sees the fields.
// `details()` writes what a caller keeps beside the status word (the backward's task and
// counter), before the code is published.
template <class Details>
__device__ inline void report(MegakernelControl* control, core::MegakernelStatus status, Details&& details) {
  if (atomic_cas<MemoryOrder::relaxed, Scope::gpu>(&control->claim, 0, 1) != 0) return;
  const core::StatusCode code = status.code;
  status.code = core::StatusCode::ok;
  control->status = status;
  details();
  fence<MemoryOrder::seq_cst, Scope::gpu>();
  atomic_store<MemoryOrder::relaxed, Scope::sys>(reinterpret_cast<int32_t*>(&control->status.code),
                                                 static_cast<int32_t>(code));
}
__device__ inline void report(MegakernelControl* control, core::MegakernelStatus status) {
  report(control, status, [] {});
}

// The CTA's place in the order CTAs start (uniform over the CTA): roles go by it, not by
// blockIdx, so the CTAs that run first are the ones the others wait on. -1 when the schedule
// already failed (capacity, bad routing): read by one thread, so the whole CTA leaves together.
__device__ inline int arrival_index(MegakernelControl* control) {
  __shared__ int index;
  if (threadIdx.x == 0)
    index = failed(control) ? -1 : int(atomic_fetch_add<MemoryOrder::relaxed, Scope::gpu>(&control->arrivals, 1u));
  sync(kCtaGroup);
  return index;
}

enum class WaitOutcome { reached, failed, timed_out };

// Polls `counter` until it reaches `target` (relaxed polling with backoff, then one acquire
// fence and a proxy fence: the waiting thread issues, or hands to the TMA thread, loads of rows
// other CTAs stored), at most timeout_ns. `seen`: the last value read. failed: another CTA
// already reported a failure.
__device__ inline WaitOutcome wait_counter(const int64_t* counter, int64_t target, const MegakernelControl* control,
                                           uint64_t timeout_ns, int64_t& seen) {
  uint64_t start = 0;
  unsigned sleep_ns = 32;
  for (;;) {
    seen = atomic_load<MemoryOrder::relaxed, Scope::gpu>(counter);
    if (seen >= target) {
      fence<MemoryOrder::acq_rel, Scope::gpu>();  // the acquire of the relaxed polls
      fence_proxy_async_global();
      return WaitOutcome::reached;
    }
    if (failed(control)) return WaitOutcome::failed;
    const uint64_t now = global_ns();
    if (start == 0) {
      start = now;
    } else if (now - start > timeout_ns) {
      return WaitOutcome::timed_out;
    }
    __nanosleep(sleep_ns);
    // Capped low: a counter is usually released within a few hundred ns of the first miss, and
    // a longer sleep would leave the waiting CTA idle after its rows arrived.
    if (sleep_ns < kMaxBackoffNs) sleep_ns *= 2;
  }
}

// The thread that issues (comm: thread 0) or hands to the TMA thread (compute: the scheduler
// thread) the task's loads: waits until the task's counter reaches its target. False when this
// or another CTA failed.
__device__ inline bool wait_for(const MegakernelLaunch& p, const core::MegakernelPlan& plan, const core::Task& task) {
  const core::CounterRef need = core::task_wait(plan, task);
  if (need.kind == core::CounterKind::none) return !failed(p.control);
  int64_t seen = 0;
  const WaitOutcome outcome =
      wait_counter(p.counters + core::counter_index(plan, need), need.target, p.control, p.timeout_ns, seen);
  if (outcome == WaitOutcome::timed_out) {
    core::MegakernelStatus s;
    s.code = core::StatusCode::timeout;
    s.stage = task.kind;
    s.counter = need.kind;
    s.minibatch = task.step < 0 ? -1 : core::minibatch_of_step(plan, task.step);
    s.row_tile = task.row_tile;
    s.target = need.target;
    s.observed = seen;
    report(p.control, s);
  }
  return outcome == WaitOutcome::reached;
}

// One thread, after the barrier that ends the task for every thread that stored its outputs.
// Release: every store this CTA made before that barrier is visible to a thread that acquires
// the counter (bar.sync orders the CTA's stores before this thread's release).
__device__ inline void release_done(const MegakernelLaunch& p, const core::MegakernelPlan& plan,
                                    const core::Task& task) {
  const core::CounterRef done = core::task_release(plan, task);
  if (done.kind != core::CounterKind::none)
    atomic_add<MemoryOrder::release, Scope::gpu, 1>(p.counters + core::counter_index(plan, done));
}

__device__ inline void record(TimelineRecord* timeline, uint64_t ticket, uint64_t start, int cta,
                              const core::Task& task) {
  if (!timeline) return;
  timeline[ticket] = {int64_t(start), int64_t(global_ns()), int32_t(cta), int32_t(task.kind), task.step, task.row_tile};
}

// The task loop every CTA of one role runs: thread 0 takes a ticket and waits for the task's
// counter; the CTA runs it; thread 0 releases. Tasks past the schedule's rows run as no-ops
// that still release, so counter targets never depend on the routing. `cta`: arrival index.
template <class Decode, class Run>
__device__ void task_loop(const MegakernelLaunch& p, const core::MegakernelPlan& plan, int cta,
                          unsigned long long* ticket_word, uint64_t task_count, TimelineRecord* timeline, Decode decode,
                          Run run) {
  __shared__ core::Task shared_task;
  __shared__ uint64_t shared_ticket;
  __shared__ bool proceed;
  for (;;) {
    uint64_t start = 0;
    if (threadIdx.x == 0) {
      const uint64_t t = atomic_fetch_add<MemoryOrder::relaxed, Scope::gpu>(ticket_word, 1ull);
      shared_ticket = t;
      shared_task = t < task_count ? decode(plan, int64_t(t)) : core::Task{};
      proceed = shared_task.kind != core::TaskKind::none && wait_for(p, plan, shared_task);
      start = global_ns();  // the timeline shows work, not waits
    }
    sync(kCtaGroup);
    if (!proceed) return;
    const core::Task task = shared_task;
    if (task.step < 0 || core::task_has_rows(plan, task)) run(task);
    sync(kCtaGroup);
    if (threadIdx.x == 0) {
      release_done(p, plan, task);
      record(timeline, shared_ticket, start, cta, task);
    }
  }
}

// Launches a persistent megakernel of `ctas` blocks of `threads` cooperatively: the launch fails
// instead of running when the blocks cannot all be resident at once, which the counter waits
// between CTAs need to make progress.
template <typename Params>
void launch_cooperative(void (*kernel)(Params), const Params& params, int ctas, int threads, size_t smem_bytes,
                        cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(ctas));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute cooperative = {};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  MOKA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
  MOKA_CUDA_CHECK_LAUNCH();
}

}  // namespace moka::cuda::mk
