// The forward megakernel's compute role alone (gemm_core.hpp), and the launch sizes it shares
// with the layer (launch.hpp: sized_launch).
#include "cuda/megakernel/gemm_core.hpp"

#include <vector>

#include "cuda/common/check.hpp"
#include "cuda/layer_paths.hpp"

namespace moka::cuda {

MegakernelLaunch sized_launch(const core::MegakernelPlan& plan, const MoeShape& shape, const MegakernelConfig& config,
                              int64_t tokens, int64_t local_experts, int num_sms) {
  MegakernelLaunch l;
  l.plan = plan;
  l.num_ctas = num_sms;
  l.tokens = tokens;
  l.top_k = shape.top_k;
  l.hidden = shape.hidden;
  l.intermediate = shape.intermediate;
  l.shared_intermediate = shape.shared_intermediate;
  l.local_experts = local_experts;
  l.act = core::ActParams::of(shape);
  l.timeout_ns = static_cast<uint64_t>(config.spin_timeout_seconds * 1e9);
  return l;
}

namespace {

MoeShape routed_only(MoeShape shape) {
  shape.shared_intermediate = 0;
  return shape;
}

// One macrobatch holding every grouped row, so ring row r is grouped row r.
MegakernelConfig one_macrobatch(MegakernelConfig c, const MoeShape& shape, int64_t tokens) {
  const int64_t rows = supported_plan(shape, c, 1, tokens).capacity_rows;
  c.macrobatch_size = core::ceil_div(rows, c.minibatch_size) * c.minibatch_size;
  return c;
}

}  // namespace

MegakernelCore::MegakernelCore(const MoeShape& shape, const MegakernelConfig& config, int64_t tokens)
    : shape_(routed_only(shape)), config_(one_macrobatch(config, shape_, tokens)), tokens_(tokens),
      plan_(supported_plan(shape_, config_, 1, tokens)), num_sms_(context_sm_count()),
      initial_counters_(core::counter_count(plan_)), counters_(initial_counters_.size()), control_(1) {
  require(megakernel_ctas_per_sm() >= 1, ErrorCode::cuda, "the megakernel's CTA does not fit on an SM");
  // Every step's rows count as dispatched: the compute tiles start at once.
  std::vector<int64_t> initial(initial_counters_.size(), 0);
  for (int64_t step = 0; step < plan_.max_steps; ++step)
    initial[core::counter_index(plan_, core::counter_ref(plan_, core::CounterKind::rows_ready, step, 0))] =
        core::counter_target(plan_, core::CounterKind::rows_ready);
  initial_counters_.upload(initial.data(), initial.size(), cudaStreamLegacy);
}

void MegakernelCore::run(const GroupedExpertRows& rows, const bf16* w_gate, const bf16* w_up, const bf16* w_down,
                         cudaStream_t stream) {
  MegakernelLaunch l = sized_launch(plan_, shape_, config_, tokens_, shape_.num_experts, num_sms_);
  l.num_comm_ctas = 0;
  l.offsets = rows.offsets;
  l.x_local = rows.x;  // no shared expert: only its operand descriptor is made from it
  l.w_gate = w_gate;
  l.w_up = w_up;
  l.w_down = w_down;
  l.ring_x = const_cast<bf16*>(rows.x);  // read only: dispatch, its one writer, does not run
  l.ring_gate = rows.gate;
  l.ring_up = rows.up;
  l.ring_hidden = rows.hidden;
  l.ring_y = rows.y;
  l.counters = counters_.data();
  l.control = control_.data();
  MOKA_CUDA_CHECK(cudaMemsetAsync(control_.data(), 0, sizeof(MegakernelControl), stream));
  MOKA_CUDA_CHECK(cudaMemcpyAsync(counters_.data(), initial_counters_.data(), counters_.size() * sizeof(int64_t),
                                  cudaMemcpyDeviceToDevice, stream));
  launch_megakernel(l, stream);
}

void MegakernelCore::check_errors() {
  MegakernelControl control;
  MOKA_CUDA_CHECK(cudaMemcpy(&control, control_.data(), sizeof(control), cudaMemcpyDeviceToHost));
  core::throw_megakernel_status(control.status, config_);
}

}  // namespace moka::cuda
