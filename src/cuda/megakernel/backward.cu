// Host side of the backward megakernel: sizes its workspace from the worst-case plan, fills the
// launch, and turns the kernel's status word into an Error.
#include "cuda/megakernel/backward.hpp"

#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

#include "cuda/common/check.hpp"
#include "cuda/common/stream.hpp"
#include "cuda/megakernel/memory_order.cuh"
#include "moka/error.hpp"

namespace moka::cuda {
namespace {

using mk::atomic_load;
using mk::MemoryOrder;
using mk::Scope;

core::MegakernelBackwardPlan gpu_backward_plan(const MoeShape& s, const MegakernelConfig& config, int world,
                                               int64_t tokens, core::ContextMode mode) {
  require(config.tile_rows == 128, ErrorCode::unsupported_size,
          "megakernel backward: tile_rows must be 128 (the GEMM core's tile), got " + std::to_string(config.tile_rows));
  require(tokens >= 1, ErrorCode::invalid_argument, "megakernel backward: needs at least one token");
  const core::MegakernelDims dims{
      world, tokens, s.top_k, s.hidden, s.intermediate, s.shared_intermediate, s.num_experts / world};
  return core::build_backward_plan(config, {dims, mode, kBackwardGpuTiling});
}

__global__ void write_pointers(void** table, const PointerValues values) {
  for (int i = 0; i < values.count; ++i) table[i] = const_cast<void*>(values.at[i]);
}

// EP > 1, one thread each: this rank's failure into its slot (after the kernel); a barrier that
// timed out into the slot when it holds no failure of the rank's own (after the closing
// barrier); the lowest failing rank's slot into mapped host memory (last).
__global__ void publish_status_kernel(const BackwardControl* control, BackwardStatus* slot) {
  slot->status = control->base.status;
  slot->wait = control->wait;
}

__global__ void note_missing_peer_kernel(const uint64_t* barrier_error, BackwardStatus* slot) {
  const uint64_t missing = atomic_load<MemoryOrder::relaxed, Scope::sys>(barrier_error);
  if (missing == 0 || slot->status.code != core::StatusCode::ok) return;
  BackwardStatus s;
  s.status.code = core::StatusCode::peer_missing;
  s.status.source_rank = static_cast<int64_t>(missing) - 1;
  *slot = s;
}

// EP = 1: the rank's own failure as the merged status.
__global__ void own_status_kernel(const BackwardControl* control, MergedBackwardStatus* merged) {
  MergedBackwardStatus m;
  if (control->base.status.code != core::StatusCode::ok) {
    m.rank = 0;
    m.failure = {control->base.status, control->wait};
  }
  *merged = m;
}

__global__ void merge_status_kernel(BackwardStatus* const* slots, int world, MergedBackwardStatus* merged) {
  MergedBackwardStatus m;
  for (int r = 0; r < world && m.rank < 0; ++r) {
    const BackwardStatus s = *slots[r];
    if (s.status.code != core::StatusCode::ok) {
      m.rank = r;
      m.failure = s;
    }
  }
  *merged = m;
}

// A call's ring and the shared expert's rows, from the layer's allocator on the call's stream,
// sized by the call's plan (core::backward_workspace_elements, which also says what each holds)
// and given back (stream-ordered) when the call has enqueued its work.
struct CallWorkspace {
  DeviceArray<bf16> ring_bf16, shared_bf16;
  DeviceArray<float> ring_float, shared_partials, carries;
  CallWorkspace(const core::MegakernelBackwardPlan& plan, bool overwrite, bool dx_in_ring, DeviceAllocator& from,
                cudaStream_t stream) {
    const core::BackwardWorkspaceElements e = core::backward_workspace_elements(plan, overwrite, dx_in_ring);
    ring_bf16 = DeviceArray<bf16>(size_t(e.ring_bf16), from, stream);
    shared_bf16 = DeviceArray<bf16>(size_t(e.shared_bf16), from, stream);
    ring_float = DeviceArray<float>(size_t(e.ring_float), from, stream);
    shared_partials = DeviceArray<float>(size_t(e.shared_partials), from, stream);
    if (e.carries > 0) carries = DeviceArray<float>(size_t(e.carries), from, stream);
  }
};

}  // namespace

void write_pointer_table(void** table, const PointerValues& values, cudaStream_t stream) {
  write_pointers<<<1, 1, 0, stream>>>(table, values);
  MOKA_CUDA_CHECK_LAUNCH();
}

MegakernelBackward::MegakernelBackward(const MoeShape& shape, const MegakernelConfig& config, int world_size,
                                       int64_t max_tokens, core::ContextMode mode, int num_ctas, BackwardRanks ranks,
                                       DeviceAllocator* allocator)
    : shape_(shape), config_(config), world_(world_size), ranks_(std::move(ranks)),
      allocator_(allocator ? allocator : &default_device_allocator()), max_tokens_(max_tokens),
      plan_(gpu_backward_plan(shape, config, world_size, max_tokens, mode)), last_plan_(plan_),
      num_ctas_(num_ctas > 0 ? num_ctas : context_sm_count()) {
  const int64_t tokens = max_tokens;
  require(world_size == 1 || (ranks_.barrier && ranks_.barrier_error && ranks_.status_peers && ranks_.own_status),
          ErrorCode::invalid_argument,
          "megakernel backward over " + std::to_string(world_size) +
              " ranks needs the ranks' barrier, its error word and every rank's status slot");
  require(megakernel_backward_ctas_per_sm() >= 1, ErrorCode::cuda,
          "the backward megakernel's CTA does not fit on an SM");
  // Every kernel a call enqueues is loaded now, not at its first launch after a barrier
  // (load_megakernel_backward_kernels says why).
  load_megakernel_backward_kernels();
  cudaFuncAttributes attributes;
  for (const void* kernel :
       {reinterpret_cast<const void*>(publish_status_kernel), reinterpret_cast<const void*>(note_missing_peer_kernel),
        reinterpret_cast<const void*>(own_status_kernel), reinterpret_cast<const void*>(merge_status_kernel)})
    MOKA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  require(config.num_comm_sms >= 1 && config.num_comm_sms < num_ctas_, ErrorCode::invalid_argument,
          "megakernel backward: num_comm_sms " + std::to_string(config.num_comm_sms) +
              " must be >= 1 and leave a compute CTA of " + std::to_string(num_ctas_));
  ones_ = DeviceArray<float>(size_t(tokens));
  const std::vector<float> ones(size_t(tokens), 1.f);
  ones_.upload(ones, cudaStreamLegacy);
  expert_offset_ = DeviceArray<int64_t>(size_t(shape.num_experts / world_size + 1));
  segments_ = DeviceArray<core::WeightGradSegment>(size_t(core::max_segments(plan_)));
  first_of_step_ = DeviceArray<int64_t>(size_t(plan_.max_steps + 1));
  counters_ = DeviceArray<int64_t>(size_t(core::counter_count(plan_)));
  control_ = DeviceArray<BackwardControl>(1);
  MOKA_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
}

MegakernelBackward::~MegakernelBackward() { cudaEventDestroy(done_); }

void MegakernelBackward::run(const MegakernelBackwardIo& io, int64_t tokens, cudaStream_t stream, StageClock* clock) {
  auto mark = [&](const char* stage) {
    if (clock) clock->mark(stage, stream);
  };
  require(tokens >= 1 && tokens <= max_tokens_, ErrorCode::capacity_exceeded,
          "megakernel backward call has " + std::to_string(tokens) + " tokens, its workspace holds 1 to " +
              std::to_string(max_tokens_));
  const int64_t H = shape_.hidden, I = shape_.intermediate, Is = shape_.shared_intermediate;
  last_plan_ = gpu_backward_plan(shape_, config_, world_, tokens, plan_.mode);
  const bool overwrite = io.overwrite_context && !replay() && last_plan_.max_macrobatches == 1;
  require(!io.dx_into_slots || (world_ == 1 && io.dx_slots), ErrorCode::invalid_argument,
          "megakernel backward: dx_into_slots (the dx tiles storing into the d_x slots) needs EP = 1 and dx_slots");
  const CallWorkspace workspace(last_plan_, overwrite, !io.dx_into_slots, *allocator_, stream);
  const int64_t ring = last_plan_.ring_rows, shared_rows = last_plan_.shared_row_tiles * last_plan_.tile_m;
  MegakernelBackwardLaunch l;
  l.plan = last_plan_;
  l.num_ctas = num_ctas_;
  l.num_comm_ctas = config_.num_comm_sms;
  l.tokens = tokens;
  l.top_k = shape_.top_k;
  l.hidden = H;
  l.intermediate = I;
  l.shared_intermediate = Is;
  l.local_experts = int64_t(expert_offset_.size()) - 1;
  l.act = core::ActParams::of(shape_);
  l.timeout_ns = static_cast<uint64_t>(config_.spin_timeout_seconds * 1e9);
  l.io = io;
  bf16* b = workspace.ring_bf16.data();
  for (bf16** at : {&l.ring_d_out, &l.ring_x}) *at = std::exchange(b, b + ring * H);
  if (!io.dx_into_slots) l.ring_dx = std::exchange(b, b + ring * H);
  if (overwrite) {
    l.ring_dg = io.context_gate;
    l.ring_du = io.context_up;
    l.ring_hs = std::exchange(b, b + ring * I);
  } else {
    for (bf16** at : {&l.ring_dg, &l.ring_du, &l.ring_hs}) *at = std::exchange(b, b + ring * I);
  }
  bf16* s = workspace.shared_bf16.data();
  for (bf16** at : {&l.shared_dg, &l.shared_du, &l.shared_hs}) *at = std::exchange(s, s + shared_rows * Is);
  if (replay()) {
    for (bf16** at : {&l.ring_gate, &l.ring_up}) *at = std::exchange(b, b + ring * I);
    for (bf16** at : {&l.recomputed_shared_gate, &l.recomputed_shared_up}) *at = std::exchange(s, s + shared_rows * Is);
  }
  l.shared_dx = s;
  l.ring_weight = workspace.ring_float.data();
  l.ring_partials = workspace.ring_float.data() + ring;
  l.shared_partials = workspace.shared_partials.data();
  l.ones = ones_.data();
  l.carries = workspace.carries.data();
  l.expert_offset = expert_offset_.data();
  l.segments = segments_.data();
  l.first_of_step = first_of_step_.data();
  l.counters = counters_.data();
  l.control = control_.data();
  MOKA_CUDA_CHECK(cudaMemsetAsync(control_.data(), 0, sizeof(BackwardControl), stream));
  MOKA_CUDA_CHECK(cudaMemsetAsync(counters_.data(), 0, counters_.bytes(), stream));
  if (world_ == 1) {
    mark("setup");
    launch_megakernel_backward(l, stream);
    mark("megakernel");
    launch_backward_epilogue(l, stream);
    own_status_kernel<<<1, 1, 0, stream>>>(control_.data(), merged_.device());
    MOKA_CUDA_CHECK_LAUNCH();
    mark("epilogue");
    MOKA_CUDA_CHECK(cudaEventRecord(done_, stream));
    pending_ = true;
    return;
  }
  l.barrier_error = ranks_.barrier_error;
  ranks_.barrier(stream);  // every rank's d_out, route weights (and x) written; its slots free
  mark("setup");
  launch_megakernel_backward(l, stream);
  mark("megakernel");
  publish_status_kernel<<<1, 1, 0, stream>>>(control_.data(), ranks_.own_status);
  MOKA_CUDA_CHECK_LAUNCH();
  ranks_.barrier(stream);  // every push into this rank's slots landed; no peer pulls from it any more
  launch_backward_epilogue(l, stream);
  note_missing_peer_kernel<<<1, 1, 0, stream>>>(ranks_.barrier_error, ranks_.own_status);
  MOKA_CUDA_CHECK_LAUNCH();
  merge_status_kernel<<<1, 1, 0, stream>>>(ranks_.status_peers, world_, merged_.device());
  MOKA_CUDA_CHECK_LAUNCH();
  mark("epilogue");
  MOKA_CUDA_CHECK(cudaEventRecord(done_, stream));
  pending_ = true;
}

void MegakernelBackward::throw_failure(const BackwardStatus& failure, const std::string& prefix) const {
  const core::MegakernelStatus& s = failure.status;
  const BackwardWaitReport& w = failure.wait;
  std::ostringstream os;
  os << prefix;
  if (s.code == core::StatusCode::timeout && w.kind != core::BackwardTaskKind::none) {
    os << core::describe(last_plan_, {w.kind, w.step, w.row_tile, w.col_tile, w.segment}) << " timed out after "
       << config_.spin_timeout_seconds << " s waiting for " << core::to_string(w.counter) << " " << w.at << " to reach "
       << w.target << ", saw " << w.observed;
    throw Error(ErrorCode::timeout, os.str());
  }
  if (s.code == core::StatusCode::peer_missing) {
    os << "rank " << s.source_rank << " did not arrive at the backward's device barrier within "
       << config_.spin_timeout_seconds << " s; this call's gradients are incomplete";
    throw Error(ErrorCode::timeout, os.str());
  }
  try {
    core::throw_megakernel_status(s, config_);
  } catch (const Error& e) {
    // what() starts with the code's name, which the new Error puts in front again.
    throw Error(e.code(), prefix + std::string(e.what()).substr(std::strlen(to_string(e.code())) + 2));
  }
}

void MegakernelBackward::check_errors() {
  pending_ = false;
  const MergedBackwardStatus merged = merged_.load();
  if (merged.rank < 0) return;
  merged_.store(MergedBackwardStatus{});  // each failure is raised once
  throw_failure(merged.failure, world_ == 1 ? "megakernel backward: "
                                            : "megakernel backward: rank " + std::to_string(merged.rank) + ": ");
}

void MegakernelBackward::raise_finished_errors(cudaStream_t stream) {
  if (!pending_ || is_capturing(stream) || cudaEventQuery(done_) != cudaSuccess) return;
  check_errors();
}

}  // namespace moka::cuda
