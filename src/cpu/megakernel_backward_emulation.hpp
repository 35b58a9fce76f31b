// CPU emulation of the backward megakernel: executes the plan of
// core/megakernel_backward_plan.hpp with real threads, from the forward emulation's saved state
// (cpu/megakernel_emulation.hpp). Per rank: `config.num_comm_sms` communication workers and
// `num_compute_workers` compute workers take tasks from two atomic tickets; counters are
// std::atomic with release adds and acquire waits, every wait is bounded; pulls read d_out,
// the router weights (and, in replay, x) from the peers' published buffers, pushes write d_x
// rows and d_topk_weights into the origin rank's slots token*k+j.
//
// Bits (docs/MEGAKERNEL.md, "Backward plan"): d_x, the shared expert's gradients, and dW at one
// rank are bitwise equal to the CPU reference backward; d_topk_weights is too while one column
// tile covers I (beyond, its per-tile partials are summed in column order, the reference sums
// all of I in one pass); routed dW over several ranks sums each expert's rows in the grouped
// order (the reference in (source, slot) order). Every output is bitwise the same for any
// worker split, minibatch and macrobatch.
#pragma once
#include <functional>
#include <vector>

#include "core/megakernel_backward_plan.hpp"
#include "cpu/megakernel_emulation.hpp"

namespace moka::cpu {

struct MegakernelBackwardOptions {
  // num_comm_sms = communication workers; tile_rows must be the forward's; minibatch_size and
  // macrobatch_size cut the backward's own ring.
  core::MegakernelConfig config;
  core::BackwardTiling tiling;
  core::ContextMode mode = core::ContextMode::resident;
  int num_compute_workers = 2;
  // Fault injection for tests: every worker calls it before it runs a task (it may sleep).
  std::function<void(int rank, const core::BackwardTask&)> before_task;
};

struct MegakernelBackwardResult {
  core::MegakernelBackwardPlan plan;  // trimmed to this call's rows
  core::SegmentTableStorage segments;
  std::vector<int64_t> final_counters;  // each counter at kernel end, in counter_index order
};

// Collective over `group` (null for one rank), like MoeLayer::backward; T is float or double.
// `in` is the forward's input (x, and the router weights the pulls read) and `saved` what the
// forward emulation left: resident mode needs its ring to hold every routed row (a forward
// macrobatch_size >= the rows), replay mode reads only its schedule. Errors (a bad context,
// capacity_exceeded, timeout) are raised on every rank.
template <typename T>
MegakernelBackwardResult megakernel_backward(ProcessGroup* group, const MoeShape& shape, const MoeInputs& in,
                                             const MoeWeights& weights, const MegakernelSavedState<T>& saved,
                                             const TensorView& d_out, const MoeGradients& grads,
                                             const MegakernelBackwardOptions& options);

}  // namespace moka::cpu
