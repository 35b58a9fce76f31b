// The compute CTAs' pipeline, shared by the forward and the backward megakernel: a two-slot task
// queue in shared memory between the scheduler thread (takes tickets, waits on each task's
// counters, publishes the task's job), the producer threads (the TMA thread; the forward's store
// thread) and the 256 consumer threads, with the phase arithmetic of its barriers. The roles and
// why a slot frees only after every reader arrived: forward_compute.cuh's top comment.
#pragma once
#include <cstdint>

#include "core/megakernel_plan.hpp"
#include "cuda/megakernel/sync.cuh"
#include "cuda/megakernel/tile_gemm.cuh"

namespace moka::cuda::mk {

inline constexpr int kTaskSlots = 2;

// The task queue between the scheduler thread and the TMA thread, the consumers and the store
// thread (the backward megakernel's queue holds its own job type).
template <class Job>
struct TaskQueueOf {
  Job jobs[kTaskSlots];
  alignas(8) uint64_t published[kTaskSlots];  // one arrival: the scheduler wrote the slot
  // The TMA thread, every consumer thread and the store thread arrive once they read the slot
  // for the last time (the store thread after it released the task's counter):
  // each reader's own arrival (and its own wait on `published`) orders its reads in a way
  // compute-sanitizer's racecheck follows, which a barrier relayed through one thread is not.
  alignas(8) uint64_t finished[kTaskSlots];
};

// One thread: the queue's barriers; `readers` arrive on each slot's `finished`.
template <class Job>
__device__ inline void init_task_queue(TaskQueueOf<Job>& queue, uint32_t readers) {
  for (int q = 0; q < kTaskSlots; ++q) {
    EmptyBarrier::init(&queue.published[q], 1);
    EmptyBarrier::init(&queue.finished[q], readers);
  }
}

inline constexpr ThreadGroup<1, kConsumerThreads> kConsumerGroup{};  // named barrier 1: the 256 consumer threads

__device__ inline uint32_t slot_phase(uint32_t n) { return (n / kTaskSlots) & 1u; }

// The scheduler thread: publishes jobs until the tickets run out, then a stop.
// fill(ticket, job): once the wait of ticket `ticket` (of the counter `tickets`) passed, writes
// its job into `job`, the free slot, which holds a stop until then (no task left, or the wait
// failed: it stays a stop). When the wait for a free slot fails, the slot's readers may still be
// reading it: the scheduler leaves it untouched and returns; the readers' next waits fail at once
// (a failure is recorded). Both megakernels' schedulers.
template <class Job, class Fill>
__device__ inline void schedule_jobs(TaskQueueOf<Job>& queue, unsigned long long* tickets, const PipelineWatch& watch,
                                     Fill&& fill) {
  for (uint32_t n = 0;; ++n) {
    const int q = int(n % kTaskSlots);
    // The ordered wait and arrive keep the slot's reset and the job's stores between them (the
    // compiler once hoisted the reset's constant stores above the wait: racecheck caught it
    // overwriting a job its readers still read).
    if (n >= uint32_t(kTaskSlots) &&
        !wait_phase_ordered(&queue.finished[q], slot_phase(n) ^ 1u, watch, watch.queue_bound_ns,
                            core::PipelineWait::task_finished, TaskSite{}))
      return;
    Job& job = queue.jobs[q];
    job = Job{};
    fill(uint64_t(atomic_fetch_add<MemoryOrder::relaxed, Scope::gpu>(tickets, 1ull)), job);
    const bool stop = job.stop;
    arrive_ordered(&queue.published[q]);  // release (CTA scope): the slot's contents
    if (stop) {
      // Observe the last slots' `finished` phases (the readers arrive on them too for the stop).
      for (uint32_t m = n > 0 ? n - 1 : 0; m <= n; ++m)
        wait_phase_ordered(&queue.finished[m % kTaskSlots], slot_phase(m), watch, watch.queue_bound_ns,
                           core::PipelineWait::task_finished, TaskSite{});
      return;
    }
  }
}

// A producer thread's job loop (the TMA thread, the store thread): runs each published job
// until the stop or a failed wait, then arrives on the slot's `finished`. Both threads' TMA
// touches rows the scheduler thread acquired the counter of (loads read rows other CTAs wrote;
// stores overwrite ring rows other CTAs read before releasing), through the async proxy: the
// fence orders it after that acquire, which the thread's wait on `published` follows.
template <class Job, class Run>
__device__ inline void producer_jobs(TaskQueueOf<Job>& queue, const PipelineWatch& watch, Run&& run) {
  for (uint32_t n = 0;; ++n) {
    const int q = int(n % kTaskSlots);
    if (!wait_phase_ordered(&queue.published[q], slot_phase(n), watch, watch.queue_bound_ns,
                            core::PipelineWait::task_published, TaskSite{}))
      return;
    const Job& job = queue.jobs[q];
    const bool stop = job.stop;
    if (!stop) {
      fence_proxy_async_global();
      run(job, q);
    }
    arrive_ordered(&queue.finished[q]);  // no read of the slot moves below it
    if (stop) return;
  }
}

// The 256 consumer threads' job loop: run(job, q) for each published job, at_stop() at the
// stop; both megakernels' consumers. The leader thread (consumer 0) waits for each job and
// tells the others through a named barrier (a flag per slot: the leader writes a slot's next
// flag only after every consumer passed the barrier that follows its reads of the previous
// one), so all consumers see the same job or the same stop and reach the same barriers; then
// every consumer acquires the (completed) phase itself before it reads the slot.
template <class Job, class Run, class AtStop>
__device__ __forceinline__ void consumer_jobs(TaskQueueOf<Job>& queue, const PipelineWatch& watch, Run&& run,
                                              AtStop&& at_stop) {
  __shared__ bool job_ready[kTaskSlots];
  const bool leader = consumer_thread() == 0;
  for (uint32_t n = 0;; ++n) {
    const int q = int(n % kTaskSlots);
    if (leader)
      job_ready[q] = wait_phase_ordered(&queue.published[q], slot_phase(n), watch, watch.queue_bound_ns,
                                        core::PipelineWait::task_published, TaskSite{});
    sync(kConsumerGroup);  // the flag's write before, its reads after
    if (!job_ready[q]) return;
    // Complete (the leader saw it): returns at once.
    wait_phase_ordered(&queue.published[q], slot_phase(n), watch, watch.queue_bound_ns,
                       core::PipelineWait::task_published, TaskSite{});
    const Job& job = queue.jobs[q];
    if (job.stop) {
      at_stop();
      arrive_ordered(&queue.finished[q]);
      return;
    }
    run(job, q);
    arrive_ordered(&queue.finished[q]);  // no read of the slot moves below it
  }
}

}  // namespace moka::cuda::mk
