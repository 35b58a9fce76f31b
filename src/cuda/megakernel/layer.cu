// Host side of the forward megakernel: buffers, the per-call launch sequence and error reports.
// The sequence (stream-ordered, no host synchronization; docs/MEGAKERNEL.md):
//   zero counters/control -> x into the symmetric x buffer -> routing ids (+ token count) into
//   every peer's routing buffer -> device barrier (pull sources frozen) -> receive schedule over
//   every source's ids (build_schedule) and its checks (status word) -> megakernel -> publish
//   status -> device barrier (every push landed) -> epilogue out = shared + sum_j w_j combine[t*k+j]
//   -> merged status of all ranks into mapped host memory.
// With one GPU and no group the "symmetric" buffers are plain allocations and there are no
// barriers: dispatch pulls from this GPU's own x.
#include <algorithm>
#include <cstring>
#include <mutex>

#include "core/megakernel_plan.hpp"
#include "core/validate.hpp"
#include "cuda/common/check.hpp"
#include "cuda/layer_paths.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/common/stream.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/megakernel/backward.hpp"
#include "cuda/megakernel/gemm_core.hpp"
#include "cuda/megakernel/launch.hpp"
#include "moka/device_group.hpp"

namespace moka::cuda {
namespace {

// One buffer on every rank of the group, each addressable by every rank (or a plain allocation
// on a single GPU, with a one-entry peer table).
class SymmetricBuffers {
 public:
  SymmetricBuffers(DeviceGroup* group, size_t bytes) {
    if (group) {
      buffer_ = &group->allocate_symmetric(bytes);
      return;
    }
    local_ = DeviceArray<std::byte>(bytes);
    table_ = DeviceArray<void*>(1);
    void* local = local_.data();
    table_.upload(&local, 1);
  }
  template <typename T>
  T* local() const {
    return static_cast<T*>(buffer_ ? buffer_->local : static_cast<void*>(local_.data()));
  }
  template <typename T>
  T* const* peers() const {
    return reinterpret_cast<T* const*>(buffer_ ? buffer_->peers_device : table_.data());
  }

 private:
  const SymmetricBuffer* buffer_ = nullptr;
  DeviceArray<std::byte> local_;
  DeviceArray<void*> table_;
};

core::MegakernelDims dims_of(const MoeShape& s, int world, int64_t tokens) {
  return {world, tokens, s.top_k, s.hidden, s.intermediate, s.shared_intermediate, s.num_experts / world};
}

// What one forward leaves its backward, in the layer's allocator's memory and owned by the
// forward's context (so any number of forwards may be in flight, their backwards in any order):
// the schedule (each local expert's padded segment, the slot of every grouped row, the rows per
// expert) and, when the backward is resident, the grouped g and u rows and the shared expert's.
struct ForwardSaved {
  DeviceArray<int32_t> counts, offsets, slot_of_row;
  DeviceArray<bf16> gate, up, shared_gate, shared_up;

  int64_t bytes() const {
    return int64_t(counts.bytes() + offsets.bytes() + slot_of_row.bytes() + gate.bytes() + up.bytes() +
                   shared_gate.bytes() + shared_up.bytes());
  }
  // The backward's stream: the memory goes back after its work.
  void used_on(cudaStream_t s) const {
    for (const auto* a : {&counts, &offsets, &slot_of_row}) a->release_on(s);
    for (const auto* a : {&gate, &up, &shared_gate, &shared_up}) a->release_on(s);
  }
};

// The megakernel forward of one layer: its buffers, launch sequence and error reports. Its
// schedule scratch, counters and status words are shared by its calls, which the layer orders.
class CudaMegakernelForward final : public MegakernelExtension {
 public:
  CudaMegakernelForward(const MoeShape& shape, DeviceGroup* group, const MegakernelConfig& config, int64_t max_tokens,
                        SaveMode save, DeviceAllocator& allocator)
      : shape_(shape), config_(config), group_(group), allocator_(allocator), world_(group ? group->size() : 1),
        rank_(group ? group->rank() : 0), experts_(shape.num_experts / world_), max_tokens_(max_tokens),
        worst_(supported_plan(shape, config, world_, max_tokens)),
        resident_(save == SaveMode::gate_up && worst_.ring_rows >= worst_.capacity_rows),
        barrier_error_(group ? static_cast<const uint64_t*>(group->device_barrier_error()) : nullptr),
        x_(group, max_tokens * shape.hidden * sizeof(bf16)),
        routing_(group, world_ * routing_region_ints(max_tokens, shape.top_k) * sizeof(int32_t)),
        combine_(group
                     ? std::make_unique<SymmetricBuffers>(group, max_tokens * shape.top_k * shape.hidden * sizeof(bf16))
                     : nullptr),
        status_(group, sizeof(core::MegakernelStatus)), ids_(world_ * max_tokens * shape.top_k),
        chunk_counts_(schedule_chunks(world_ * max_tokens * shape.top_k) * experts_ * world_),
        source_counts_(experts_ * world_), row_of_slot_(world_ * max_tokens * shape.top_k),
        counters_(core::counter_count(worst_)), control_(1), routing_error_(kNoRoutingError) {
    MOKA_CUDA_CHECK(cudaGetDevice(&device_));
    num_sms_ = context_sm_count();
    core::validate_megakernel_grid(config_, num_sms_);
    require(megakernel_ctas_per_sm() >= 1, ErrorCode::cuda, "the megakernel's CTA does not fit on an SM");
    MOKA_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  ~CudaMegakernelForward() override { cudaEventDestroy(done_); }

  const MegakernelConfig& config() const override { return config_; }

  // `clock` gets the call's stages: inputs, schedule, megakernel, combine, status. `saved` gets
  // what the backward reads.
  void forward(const MoeInputs& in, const MoeWeights& w, const TensorView& out, Stream stream, StageClock& clock,
               ForwardSaved& saved) {
    const int64_t T = in.x.rank == 2 ? in.x.dim(0) : 0, H = shape_.hidden, k = shape_.top_k;
    check_inputs(in, w, out, T);
    const cudaStream_t s = to_cuda(stream);
    const core::MegakernelPlan plan = core::build_megakernel_plan(config_, dims_of(shape_, world_, T));
    last_plan_ = plan;
    ++generation_;
    saved = allocate_saved(plan, T, s);

    MOKA_CUDA_CHECK(cudaMemsetAsync(control_.data(), 0, sizeof(MegakernelControl), s));
    MOKA_CUDA_CHECK(cudaMemsetAsync(counters_.data(), 0, core::counter_count(plan) * sizeof(int64_t), s));
    MOKA_CUDA_CHECK(cudaMemcpyAsync(x_.local<bf16>(), in.x.data, T * H * sizeof(bf16), cudaMemcpyDeviceToDevice, s));
    exchange_routing({routing_.peers<int32_t>(), world_, rank_, T, k, max_tokens_}, in.topk_ids.as<int32_t>(), s);
    barrier(s);
    clock.mark("inputs", s);

    const ScheduleCheck check{routing_.local<int32_t>(),
                              world_,
                              T,
                              k,
                              max_tokens_,
                              shape_.num_experts,
                              experts_,
                              plan.capacity_rows,
                              saved.offsets.data(),
                              row_of_slot_.data(),
                              saved.slot_of_row.data(),
                              control_.data(),
                              barrier_error_};
    gather_source_ids(check, ids_.data(), s);
    build_schedule(device_schedule(T, saved), ids_.data(), world_ == 1 ? in.topk_weights.as<float>() : nullptr, s);
    finish_schedule(check, s);
    clock.mark("schedule", s);

    const ForwardScratch scratch(*this, plan, T, s);
    launch_megakernel(launch(plan, T, w, scratch, saved), s);
    clock.mark("megakernel", s);
    if (!backward_is_resident())  // the backward recomputes g and u: they were the call's scratch
      for (DeviceArray<bf16>* a : {&saved.gate, &saved.up, &saved.shared_gate, &saved.shared_up}) a->release();
    if (timeline_on_)
      MOKA_CUDA_CHECK(cudaMemcpyAsync(last_rows_.data(), saved.offsets.data() + experts_, sizeof(int32_t),
                                      cudaMemcpyDeviceToDevice, s));
    publish_status(control_.data(), status_.local<core::MegakernelStatus>(), s);
    barrier(s);
    combine_tokens(scratch.combine, in.topk_weights.as<float>(),
                   shape_.has_shared() ? scratch.shared_out.data() : nullptr, out.as<bf16>(), nullptr, T, k, H, s);
    clock.mark("combine", s);
    merge_status(status_.peers<core::MegakernelStatus>(), world_, merged_.device(), s);
    CallOutputs outputs;
    outputs.add(out.data, T * H * sizeof(bf16));
    fill_nan_on_failure(&merged_.device()->status.code, routing_error_.device(), failed_.data(), outputs, s);
    clock.mark("status", s);
    MOKA_CUDA_CHECK(cudaEventRecord(done_, s));
    pending_ = true;
  }

  // Errors of an earlier call whose work has finished (no waiting: the layer never synchronizes;
  // nothing while `stream` is being captured, where the event cannot be queried).
  void raise_finished_errors(cudaStream_t stream) {
    if (!pending_ || is_capturing(stream) || cudaEventQuery(done_) != cudaSuccess) return;
    check_errors();
  }

  void check_errors() {
    pending_ = false;
    const MergedStatus merged = merged_.load();
    // The megakernel's own report of a barrier timeout names the missing rank, as the group's
    // does, and also says that no peer rows were read.
    if (group_ && merged.status.code != core::StatusCode::peer_missing) group_->check_device_errors();
    raise(merged, routing_error_.load());
  }

  void record_timeline(bool on) override {
    if (on && timeline_compute_.empty()) {
      // One record per ticket of the largest schedule the tables hold.
      const core::MegakernelPlan full = core::trim_to_rows(worst_, worst_.capacity_rows);
      timeline_compute_ = DeviceArray<TimelineRecord>(core::compute_task_count(full));
      timeline_comm_ = DeviceArray<TimelineRecord>(core::comm_task_count(full));
    }
    timeline_on_ = on;
  }

  std::vector<MegakernelTaskSpan> timeline() override {
    std::vector<MegakernelTaskSpan> spans;
    if (!timeline_on_ || last_plan_.tokens == 0) return spans;
    const core::MegakernelPlan plan = trimmed_last_plan();
    append_spans(timeline_comm_, core::comm_task_count(plan), spans);
    append_spans(timeline_compute_, core::compute_task_count(plan), spans);
    return spans;
  }

  // Forwards run; at EP > 1 the symmetric x holds the latest one's tokens.
  uint64_t generation() const { return generation_; }
  int device() const { return device_; }
  bf16* const* x_peers() const { return x_.peers<bf16>(); }
  bf16* x_local() const { return x_.local<bf16>(); }
  // Resident: the ring holds every routed row of any call (one macrobatch of the worst case), so
  // ring row r is grouped row r and g and u of every row are the forward's to keep (the
  // backward pulls x's rows again from their origin, as dispatch did). Else, or with
  // SaveMode::none, replay: the backward recomputes g and u.
  bool backward_is_resident() const override { return resident_; }
  // EP > 1: the combine slots [max_tokens*k, H] of every rank, free between forwards (the
  // backward's d_x slots); null at EP = 1, where each call takes its own.
  bf16* const* combine_peers() const { return combine_ ? combine_->peers<bf16>() : nullptr; }
  bf16* combine_slots() const { return combine_ ? combine_->local<bf16>() : nullptr; }
  DeviceAllocator& allocator() const { return allocator_; }

 private:
  void check_inputs(const MoeInputs& in, const MoeWeights& w, const TensorView& out, int64_t T) const {
    const Device dev = Device::cuda(device_);
    core::validate_layer_tensors(shape_, world_, in, w, DType::bf16, dev);
    require(T >= 1, ErrorCode::invalid_argument, "the megakernel needs at least one token");
    require(T <= max_tokens_, ErrorCode::capacity_exceeded,
            "megakernel call has " + std::to_string(T) + " tokens but was built for at most " +
                std::to_string(max_tokens_) + " (LayerOptions::max_tokens)");
    expect_tensor(out, "out", DType::bf16, dev, {T, shape_.hidden});
  }

  ForwardSaved allocate_saved(const core::MegakernelPlan& plan, int64_t T, cudaStream_t s) const {
    ForwardSaved saved;
    saved.counts = DeviceArray<int32_t>(size_t(experts_), allocator_, s);
    saved.offsets = DeviceArray<int32_t>(size_t(experts_ + 1), allocator_, s);
    saved.slot_of_row = DeviceArray<int32_t>(size_t(plan.capacity_rows), allocator_, s);
    saved.gate = DeviceArray<bf16>(size_t(plan.ring_rows * shape_.intermediate), allocator_, s);
    saved.up = DeviceArray<bf16>(size_t(plan.ring_rows * shape_.intermediate), allocator_, s);
    if (shape_.has_shared()) {
      saved.shared_gate = DeviceArray<bf16>(size_t(T * shape_.shared_intermediate), allocator_, s);
      saved.shared_up = DeviceArray<bf16>(size_t(T * shape_.shared_intermediate), allocator_, s);
    }
    return saved;
  }

  DeviceSchedule device_schedule(int64_t T, const ForwardSaved& saved) const {
    DeviceSchedule d;
    d.slots = T * shape_.top_k;
    d.num_experts = experts_;
    d.first_expert = rank_ * experts_;
    d.global_experts = shape_.num_experts;
    d.tile_rows = config_.tile_rows;
    d.top_k = shape_.top_k;
    d.world_size = world_;
    d.rank = rank_;
    d.row_order = config_.row_order;
    d.chunk_counts = chunk_counts_.data();
    d.counts = saved.counts.data();
    d.source_counts = source_counts_.data();
    d.offsets = saved.offsets.data();
    d.row_of_slot = row_of_slot_.data();
    d.error = routing_error_.device();
    return d;
  }

  // What lives only inside one forward, from the layer's allocator on its stream, sized for its
  // plan: the ring's x, hidden and y rows, the shared expert's hidden and output, and at EP = 1
  // the combine slots.
  struct ForwardScratch {
    DeviceArray<bf16> ring_x, ring_hidden, ring_y, shared_hidden, shared_out, own_combine;
    bf16* combine = nullptr;
    ForwardScratch(const CudaMegakernelForward& f, const core::MegakernelPlan& plan, int64_t T, cudaStream_t s) {
      const MoeShape& sh = f.shape_;
      ring_x = DeviceArray<bf16>(size_t(plan.ring_rows * sh.hidden), f.allocator_, s);
      ring_hidden = DeviceArray<bf16>(size_t(plan.ring_rows * sh.intermediate), f.allocator_, s);
      ring_y = DeviceArray<bf16>(size_t(plan.ring_rows * sh.hidden), f.allocator_, s);
      if (sh.has_shared()) {
        shared_hidden = DeviceArray<bf16>(size_t(T * sh.shared_intermediate), f.allocator_, s);
        shared_out = DeviceArray<bf16>(size_t(T * sh.hidden), f.allocator_, s);
      }
      if (f.combine_) {
        combine = f.combine_->local<bf16>();
        return;
      }
      own_combine = DeviceArray<bf16>(size_t(T * sh.top_k * sh.hidden), f.allocator_, s);
      combine = own_combine.data();
      PointerValues table;
      table.at[0] = combine;
      table.count = 1;
      write_pointer_table(f.own_combine_table_.data(), table, s);
    }
  };

  MegakernelLaunch launch(const core::MegakernelPlan& plan, int64_t T, const MoeWeights& w,
                          const ForwardScratch& scratch, const ForwardSaved& saved) const {
    MegakernelLaunch l = sized_launch(plan, shape_, config_, T, experts_, num_sms_);
    l.num_comm_ctas = config_.num_comm_sms;
    l.offsets = saved.offsets.data();
    l.slot_of_row = saved.slot_of_row.data();
    l.x_peers = x_.peers<bf16>();
    l.combine_peers = combine_ ? combine_->peers<bf16>() : reinterpret_cast<bf16* const*>(own_combine_table_.data());
    l.x_local = x_.local<bf16>();
    l.w_gate = w.w_gate.as<bf16>();
    l.w_up = w.w_up.as<bf16>();
    l.w_down = w.w_down.as<bf16>();
    if (shape_.has_shared()) {
      l.ws_gate = w.ws_gate.as<bf16>();
      l.ws_up = w.ws_up.as<bf16>();
      l.ws_down = w.ws_down.as<bf16>();
    }
    l.ring_x = scratch.ring_x.data();
    l.ring_gate = saved.gate.data();
    l.ring_up = saved.up.data();
    l.ring_hidden = scratch.ring_hidden.data();
    l.ring_y = scratch.ring_y.data();
    l.shared_gate = saved.shared_gate.data();
    l.shared_up = saved.shared_up.data();
    l.shared_hidden = scratch.shared_hidden.data();
    l.shared_out = scratch.shared_out.data();
    l.counters = counters_.data();
    l.control = control_.data();
    if (timeline_on_) {
      l.timeline_compute = timeline_compute_.data();
      l.timeline_comm = timeline_comm_.data();
    }
    return l;
  }

  void barrier(cudaStream_t s) {
    if (group_) group_->device_barrier(s, config_.spin_timeout_seconds);
  }

  void raise(const MergedStatus& merged, unsigned long long routing_code) {
    if (routing_code != kNoRoutingError) {
      routing_error_.store(kNoRoutingError);
      throw routing_error(routing_code, shape_.top_k, shape_.num_experts, "megakernel routing");
    }
    if (merged.rank < 0) return;
    const MergedStatus failure = merged;
    merged_.store(MergedStatus{});
    try {
      core::throw_megakernel_status(failure.status, config_);
    } catch (const Error& e) {
      // Input errors already name the rank whose input is bad (every rank finds them alike).
      const auto code = failure.status.code;
      if (code == core::StatusCode::invalid_expert || code == core::StatusCode::tokens_mismatch) throw;
      // what() starts with the code's name, which the new Error puts in front again.
      const std::string message = std::string(e.what()).substr(std::strlen(to_string(e.code())) + 2);
      throw Error(e.code(), "rank " + std::to_string(failure.rank) + ": " + message);
    }
  }

  core::MegakernelPlan trimmed_last_plan() const {
    int32_t rows = 0;
    MOKA_CUDA_CHECK(cudaMemcpy(&rows, last_rows_.data(), sizeof(int32_t), cudaMemcpyDeviceToHost));
    return core::trim_to_rows(last_plan_, rows);
  }

  static void append_spans(const DeviceArray<TimelineRecord>& records, int64_t count,
                           std::vector<MegakernelTaskSpan>& spans) {
    std::vector<TimelineRecord> host(count);
    MOKA_CUDA_CHECK(cudaMemcpy(host.data(), records.data(), count * sizeof(TimelineRecord), cudaMemcpyDeviceToHost));
    for (const TimelineRecord& r : host)
      spans.push_back(
          {r.start_ns, r.end_ns, r.cta, core::to_string(static_cast<core::TaskKind>(r.kind)), r.step, r.row_tile});
  }

  const MoeShape shape_;
  const MegakernelConfig config_;
  DeviceGroup* group_;
  DeviceAllocator& allocator_;
  const int world_, rank_;
  const int64_t experts_, max_tokens_;
  const core::MegakernelPlan worst_;
  const bool resident_;
  const uint64_t* const barrier_error_;  // the group's device-barrier error word, or null
  int device_ = 0, num_sms_ = 0;
  SymmetricBuffers x_, routing_;
  std::unique_ptr<SymmetricBuffers> combine_;  // EP > 1 (the pushes' targets); EP = 1: each call's
  SymmetricBuffers status_;
  DeviceArray<int32_t> ids_, chunk_counts_, source_counts_, row_of_slot_;
  DeviceArray<int32_t> last_rows_{1};        // the last forward's grouped rows, while a timeline is recorded
  DeviceArray<void*> own_combine_table_{1};  // EP = 1: the call's combine slots as a one-entry peer table
  DeviceArray<int64_t> counters_;
  DeviceArray<MegakernelControl> control_;
  PinnedWord<MergedStatus> merged_;
  PinnedWord<unsigned long long> routing_error_;
  DeviceArray<int> failed_{1};                                    // fill_nan_on_failure's flag
  DeviceArray<TimelineRecord> timeline_compute_, timeline_comm_;  // empty until a timeline is asked for
  bool timeline_on_ = false, pending_ = false;
  core::MegakernelPlan last_plan_;  // the last forward's worst-case plan (trimmed by its row count)
  uint64_t generation_ = 0;         // forwards run
  cudaEvent_t done_ = nullptr;
};

// A forward's context on the megakernel path: what it saved, its inputs and its generation.
struct MegakernelContext final : MoeContext {
  const void* layer = nullptr;
  uint64_t generation = 0;
  MoeInputs inputs;
  int64_t tokens = 0;
  cudaStream_t stream = nullptr;  // the forward's
  ForwardSaved saved;
  int64_t saved_bytes() const override { return saved.bytes(); }
  // Reads the routed row counts after the forward's stream (a synchronization: for tests and
  // statistics only).
  std::vector<int64_t> local_expert_rows() const override {
    std::vector<int32_t> rows(saved.counts.size());
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    MOKA_CUDA_CHECK(cudaMemcpy(rows.data(), saved.counts.data(), saved.counts.bytes(), cudaMemcpyDeviceToHost));
    return {rows.begin(), rows.end()};
  }
};

// EP > 1: what the backward megakernel's ranks share besides the forward's buffers (its d_x
// pushes land in the forward's combine slots, replay pulls x from the forward's x): d_out and
// the route weights (the pulls' sources), d_topk_weights (the pushes' targets) and the status
// slots. Allocated collectively, in the same order on every rank.
struct BackwardSymmetric {
  BackwardSymmetric(DeviceGroup* group, const MoeShape& s, int64_t max_tokens)
      : d_out(group, max_tokens * s.hidden * sizeof(bf16)), weights(group, max_tokens * s.top_k * sizeof(float)),
        d_topk_weights(group, max_tokens * s.top_k * sizeof(float)), status(group, sizeof(BackwardStatus)) {}
  SymmetricBuffers d_out, weights, d_topk_weights, status;
};

// The megakernel path of MoeLayer: forward and backward through the megakernels, for any context
// (resident: the backward reads the g and u rows the context saved; replay: it recomputes them).
// At EP > 1 both are collective calls, which every rank makes alike. Calls from several threads
// or streams are serialized: the kernels' schedule scratch, counters and status words are the
// layer's.
class MegakernelMoeLayer final : public MoeLayer {
 public:
  MegakernelMoeLayer(const MoeShape& shape, DeviceGroup* group, std::unique_ptr<DeviceGroup> owned,
                     const LayerOptions& options)
      : owned_group_(std::move(owned)), shape_(shape), world_(group ? group->size() : 1),
        rank_(group ? group->rank() : 0), kernel_(shape, group, config_of(options), options.max_tokens, options.save,
                                                  options.allocator ? *options.allocator : default_device_allocator()) {
    const auto mode = kernel_.backward_is_resident() ? core::ContextMode::resident : core::ContextMode::replay;
    const MegakernelConfig config = config_of(options);
    if (world_ == 1) {
      backward_ = std::make_unique<MegakernelBackward>(shape, config, 1, options.max_tokens, mode, 0, BackwardRanks{},
                                                       &kernel_.allocator());
      peer_tables_ = DeviceArray<void*>(5);
      return;
    }
    symmetric_ = std::make_unique<BackwardSymmetric>(group, shape, options.max_tokens);
    BackwardRanks ranks;
    ranks.barrier = [group, timeout = config.spin_timeout_seconds](cudaStream_t s) {
      group->device_barrier(s, timeout);
    };
    ranks.barrier_error = static_cast<const uint64_t*>(group->device_barrier_error());
    ranks.status_peers = symmetric_->status.peers<BackwardStatus>();
    ranks.own_status = symmetric_->status.local<BackwardStatus>();
    backward_ = std::make_unique<MegakernelBackward>(shape, config, world_, options.max_tokens, mode, 0,
                                                     std::move(ranks), &kernel_.allocator());
  }

  const MoeShape& shape() const override { return shape_; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend_name() const override { return "cuda"; }

  std::unique_ptr<MoeContext> forward(const MoeInputs& in, const MoeWeights& w, const TensorView& out,
                                      Stream stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const cudaStream_t s = to_cuda(stream);
    clock_.start(StageClock::Direction::forward, s);
    raise_finished_errors(s);
    call_order_.before(s);
    auto ctx = std::make_unique<MegakernelContext>();
    kernel_.forward(in, w, out, stream, clock_, ctx->saved);
    call_order_.after(s);
    ctx->layer = this;
    ctx->generation = kernel_.generation();
    ctx->inputs = in;
    ctx->tokens = in.x.dim(0);
    ctx->stream = s;
    return ctx;
  }
  void backward(const MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                Stream stream) override {
    run_backward(saved, d_out, w, g, to_cuda(stream), false);
  }
  void record_stage_times(bool on) override { clock_.set_on(on); }
  std::vector<StageTime> stage_times() const override { return clock_.read(); }
  void check_errors() override {
    std::lock_guard<std::mutex> lock(mutex_);
    kernel_.check_errors();
    backward_->check_errors();
  }
  MegakernelExtension* megakernel() override { return &kernel_; }

 protected:
  // A resident context's g and u become the backward's dg and du.
  void backward_overwriting(MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                            Stream stream) override {
    run_backward(saved, d_out, w, g, to_cuda(stream), true);
  }

 private:
  void run_backward(const MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                    cudaStream_t s, bool consume) {
    const auto* ctx = dynamic_cast<const MegakernelContext*>(&saved);
    require(ctx != nullptr && ctx->layer == this, ErrorCode::invalid_argument,
            "backward got a context from another layer");
    std::lock_guard<std::mutex> lock(mutex_);
    raise_finished_errors(s);
    clock_.start(StageClock::Direction::backward, s);
    call_order_.before(s);
    backward_megakernel(*ctx, d_out, w, g, s, consume);
    call_order_.after(s);
  }

  // Either direction raises the failures of earlier calls of both whose work has finished (a
  // training loop that never calls check_errors() stops at the next call).
  void raise_finished_errors(cudaStream_t s) {
    kernel_.raise_finished_errors(s);
    backward_->raise_finished_errors(s);
  }

  static MegakernelConfig config_of(const LayerOptions& o) {
    MegakernelConfig c = o.megakernel;
    c.tile_rows = o.tile_rows;
    c.row_order = o.row_order;
    return c;
  }

  // The pulls read every row's d_out, route weight and x from its origin rank; the pushes write
  // its d_x slots and d_topk_weights. EP = 1: the call's own tensors and d_x slots of its own,
  // through one-entry tables; EP > 1: d_out and the route weights copied into symmetric buffers
  // first (x too when a later forward replaced it), the d_x slots are the forward's combine
  // buffers (free between calls), d_topk_weights copied out after.
  void backward_megakernel(const MegakernelContext& ctx, const TensorView& d_out, const MoeWeights& w,
                           const MoeGradients& g, cudaStream_t s, bool consume) {
    const MoeShape& sh = shape_;
    const int64_t T = ctx.tokens;
    const Device dev = Device::cuda(kernel_.device());
    core::validate_layer_tensors(sh, world_, ctx.inputs, w, DType::bf16, dev);
    core::validate_layer_gradients(sh, world_, T, g, DType::bf16, dev);
    expect_tensor(d_out, "d_out", DType::bf16, dev, {T, sh.hidden});
    ctx.saved.used_on(s);
    MegakernelBackwardIo io;
    DeviceArray<bf16> dx_slots;  // EP = 1
    if (symmetric_) {
      auto copy = [s](void* to, const void* from, size_t bytes) {
        MOKA_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, s));
      };
      if (ctx.generation != kernel_.generation()) copy(kernel_.x_local(), ctx.inputs.x.data, ctx.inputs.x.bytes());
      copy(symmetric_->d_out.local<bf16>(), d_out.data, T * sh.hidden * sizeof(bf16));
      copy(symmetric_->weights.local<float>(), ctx.inputs.topk_weights.data, T * sh.top_k * sizeof(float));
      io.d_out_peers = symmetric_->d_out.peers<const bf16>();
      io.weight_peers = symmetric_->weights.peers<const float>();
      io.dx_slot_peers = kernel_.combine_peers();
      io.dw_slot_peers = symmetric_->d_topk_weights.peers<float>();
      io.x_peers = kernel_.x_peers();
    } else {
      PointerValues tables;
      tables.at[0] = d_out.data;
      tables.at[1] = ctx.inputs.topk_weights.data;
      dx_slots = DeviceArray<bf16>(size_t(T * sh.top_k * sh.hidden), kernel_.allocator(), s);
      tables.at[2] = dx_slots.data();
      tables.at[3] = g.d_topk_weights.data;
      tables.at[4] = ctx.inputs.x.data;
      tables.count = 5;
      write_pointer_table(peer_tables_.data(), tables, s);
      void* const* t = peer_tables_.data();
      io.d_out_peers = reinterpret_cast<const bf16* const*>(t);
      io.weight_peers = reinterpret_cast<const float* const*>(t + 1);
      io.dx_slot_peers = reinterpret_cast<bf16* const*>(t + 2);
      io.dw_slot_peers = reinterpret_cast<float* const*>(t + 3);
      io.x_peers = reinterpret_cast<const bf16* const*>(t + 4);
    }
    io.offsets = ctx.saved.offsets.data();
    io.slot_of_row = ctx.saved.slot_of_row.data();
    io.x = ctx.inputs.x.as<bf16>();
    io.d_out = d_out.as<bf16>();
    io.dx_slots = symmetric_ ? kernel_.combine_slots() : dx_slots.data();
    io.context_gate = ctx.saved.gate.data();
    io.context_up = ctx.saved.up.data();
    io.overwrite_context = consume;
    io.shared_gate = ctx.saved.shared_gate.data();
    io.shared_up = ctx.saved.shared_up.data();
    io.w_gate = w.w_gate.as<bf16>();
    io.w_up = w.w_up.as<bf16>();
    io.w_down = w.w_down.as<bf16>();
    io.d_x = g.d_x.as<bf16>();
    io.d_w_gate = g.d_w_gate.as<bf16>();
    io.d_w_up = g.d_w_up.as<bf16>();
    io.d_w_down = g.d_w_down.as<bf16>();
    if (sh.has_shared()) {
      io.ws_gate = w.ws_gate.as<bf16>();
      io.ws_up = w.ws_up.as<bf16>();
      io.ws_down = w.ws_down.as<bf16>();
      io.d_ws_gate = g.d_ws_gate.as<bf16>();
      io.d_ws_up = g.d_ws_up.as<bf16>();
      io.d_ws_down = g.d_ws_down.as<bf16>();
    }
    backward_->run(io, T, s, &clock_);
    if (symmetric_)
      MOKA_CUDA_CHECK(cudaMemcpyAsync(g.d_topk_weights.data, symmetric_->d_topk_weights.local<float>(),
                                      T * sh.top_k * sizeof(float), cudaMemcpyDeviceToDevice, s));
    CallOutputs outputs;
    for (const TensorView* v :
         {&g.d_x, &g.d_topk_weights, &g.d_w_gate, &g.d_w_up, &g.d_w_down, &g.d_ws_gate, &g.d_ws_up, &g.d_ws_down})
      outputs.add(v->data, v->bytes());
    fill_nan_on_failure(backward_->failure_code(), nullptr, backward_failed_.data(), outputs, s);
    clock_.mark("status", s);
  }

  std::unique_ptr<DeviceGroup> owned_group_;  // destroyed last: the kernels' buffers use it
  const MoeShape shape_;
  const int world_, rank_;
  CudaMegakernelForward kernel_;
  StageClock clock_;                              // record_stage_times
  DeviceArray<int> backward_failed_{1};           // fill_nan_on_failure's flag
  std::unique_ptr<BackwardSymmetric> symmetric_;  // EP > 1
  std::unique_ptr<MegakernelBackward> backward_;
  DeviceArray<void*> peer_tables_;  // EP = 1: d_out, route weights, d_x slots, d_topk_weights, x
  std::mutex mutex_;                // one call at a time
  CallOrder call_order_;            // ... on whichever stream
};

}  // namespace

core::MegakernelPlan supported_plan(const MoeShape& s, const MegakernelConfig& c, int world, int64_t max_tokens) {
  core::validate_shape(s, world);
  core::validate_megakernel_config(c);
  require(max_tokens >= 1, ErrorCode::invalid_argument,
          "the megakernel path needs LayerOptions::max_tokens >= 1 (tokens per rank its buffers hold)");
  require(c.tile_rows == 128 && c.tile_n == 128 && c.down_tile_n == 256, ErrorCode::unsupported_size,
          "the GPU megakernel's GEMM tiles are 128 x (128 gate + 128 up) and 128 x 256 (down): tile_rows and "
          "megakernel.tile_n must be 128, megakernel.down_tile_n 256");
  require(s.hidden % 8 == 0 && s.intermediate % 8 == 0 && s.shared_intermediate % 8 == 0, ErrorCode::unsupported_size,
          "the megakernel needs hidden, intermediate and shared sizes that are multiples of 8 (16-byte rows)");
  require(world <= kMaxScheduleSources, ErrorCode::unsupported_size,
          "the megakernel takes at most " + std::to_string(kMaxScheduleSources) + " ranks");
  return core::build_megakernel_plan(c, dims_of(s, world, max_tokens));
}

std::unique_ptr<MoeLayer> make_megakernel_layer(const MoeShape& shape, DeviceGroup* group,
                                                std::unique_ptr<DeviceGroup> owned, const LayerOptions& options) {
  return std::make_unique<MegakernelMoeLayer>(shape, group, std::move(owned), options);
}

}  // namespace moka::cuda
