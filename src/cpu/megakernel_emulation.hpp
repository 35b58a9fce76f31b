// CPU emulation of the forward megakernel: executes the plan of core/megakernel_plan.hpp with
// real threads, so the task order, the counters and the ring buffer are tested in CI without a
// GPU. Per rank: `config.num_comm_sms` communication workers and `num_compute_workers` compute
// workers take tasks from two global atomic tickets; counters are std::atomic with release
// adds and acquire waits, every wait is bounded; dispatch pulls rows from the peers' published
// ("symmetric") x, combine pushes rows into the origin rank's combine buffer at slot token*k+j.
// Results are bitwise identical to the CPU reference layer's forward (same row math).
#pragma once
#include <functional>
#include <vector>

#include "core/megakernel_plan.hpp"
#include "core/schedule.hpp"
#include "moka/layer.hpp"

namespace moka::cpu {

struct MegakernelEmulationOptions {
  core::MegakernelConfig config;  // config.num_comm_sms = communication worker threads
  int num_compute_workers = 2;
  // Fault injection for tests: every worker calls it before it runs a task (it may sleep).
  std::function<void(int rank, const core::Task&)> before_task;
};

// What forward leaves for backward (docs/MEGAKERNEL.md, "What backward reads").
template <typename T>
struct MegakernelSavedState {
  core::MegakernelPlan plan;  // trimmed to this call's rows
  core::ReceiveSchedule schedule;
  // Ring buffers, [plan.ring_rows, H] for x and [plan.ring_rows, I] for gate/up/hidden: at the
  // end they hold macrobatch 0 (grouped rows [0, ring_rows)), processed last.
  std::vector<T> ring_x, ring_gate, ring_up, ring_hidden;
  std::vector<T> shared_gate, shared_up, shared_hidden;  // [T, Is], every token
};

template <typename T>
struct MegakernelForwardResult {
  MegakernelSavedState<T> saved;
  std::vector<int64_t> final_counters;  // each counter at kernel end, in counter_index order
};

// Collective over `group` (null for one rank), like MoeLayer::forward; T is float or double.
// Errors (capacity_exceeded, timeout) are raised on every rank, naming the failing rank.
template <typename T>
MegakernelForwardResult<T> megakernel_forward(ProcessGroup* group, const MoeShape& shape, const MoeInputs& in,
                                              const MoeWeights& weights, const TensorView& out,
                                              const MegakernelEmulationOptions& options);

}  // namespace moka::cpu
