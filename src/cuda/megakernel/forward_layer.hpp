// The forward half of the megakernel layer (megakernel/layer.cu): its buffers, the per-call
// launch sequence and error reports, and what a forward saves for its backward. The sequence
// (stream-ordered, no host synchronization; docs/MEGAKERNEL.md):
//   zero counters/control -> x into the symmetric x buffer -> routing ids (+ token count) into
//   every peer's routing buffer -> device barrier (pull sources frozen) -> receive schedule over
//   every source's ids (build_schedule) and its checks (status word) -> megakernel -> publish
//   status -> device barrier (every push landed) -> epilogue out = shared + sum_j w_j combine[t*k+j]
//   -> merged status of all ranks into mapped host memory.
// With one GPU and no group the "symmetric" buffers are plain allocations and there are no
// barriers: dispatch pulls from this GPU's own x. Included by layer.cu only.
#pragma once
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/megakernel_memory.hpp"
#include "core/megakernel_plan.hpp"
#include "core/validate.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/common/stage_clock.hpp"
#include "cuda/common/stream.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/layer_paths.hpp"
#include "cuda/megakernel/backward.hpp"
#include "cuda/megakernel/launch.hpp"
#include "moka/device_group.hpp"
#include "moka/megakernel.hpp"

namespace moka::cuda {

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
    table_.upload(&local, 1, cudaStreamLegacy);
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

inline core::MegakernelDims dims_of(const MoeShape& s, int world, int64_t tokens) {
  return {world, tokens, s.top_k, s.hidden, s.intermediate, s.shared_intermediate, s.num_experts / world};
}

// What one forward leaves its backward, in the layer's allocator's memory and owned by the
// forward's context (so any number of forwards may be in flight, their backwards in any order):
// the schedule (each local expert's padded segment, the slot of every grouped row, the rows per
// expert) and, when the backward is resident, g and u of every routed row and the shared
// expert's: as the kernel's grouped rows, or by slot (launch.hpp's SavedRows: no padding rows,
// stored so by the kernel) where the padding would outweigh the backward's unpacking
// (core::saves_rows_by_slot). `ring_rows`: the grouped rows' count.
struct ForwardSaved {
  DeviceArray<int32_t> counts, offsets, slot_of_row;
  DeviceArray<bf16> gate, up, shared_gate, shared_up;
  int64_t ring_rows = 0, slots = 0;
  bool by_slot = false;

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

// One of the context's g and u (`by_slot`) against its grouped rows ([saved.ring_rows, I]).
inline SavedRows saved_rows(const ForwardSaved& saved, int64_t intermediate, bf16* grouped, bf16* by_slot) {
  SavedRows r;
  r.slot_of_row = saved.slot_of_row.data();
  r.schedule_rows = saved.offsets.data() + (saved.offsets.size() - 1);
  r.grouped_rows = int64_t(saved.slot_of_row.size());
  r.slots = saved.slots;
  r.width = intermediate;
  r.grouped = grouped;
  r.by_slot = by_slot;
  return r;
}

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
        x_(group ? std::make_unique<SymmetricBuffers>(group, max_tokens * shape.hidden * sizeof(bf16)) : nullptr),
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
    if (x_)
      MOKA_CUDA_CHECK(cudaMemcpyAsync(x_->local<bf16>(), in.x.data, T * H * sizeof(bf16), cudaMemcpyDeviceToDevice, s));
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

    ForwardScratch scratch(*this, plan, T, in.x.as<bf16>(), saved.by_slot, s);
    launch_megakernel(launch(plan, T, w, scratch, saved), s);
    clock.mark("megakernel", s);
    for (DeviceArray<bf16>* a : {&scratch.ring_x, &scratch.ring_hidden, &scratch.ring_y}) a->release();
    if (timeline_on_)
      MOKA_CUDA_CHECK(cudaMemcpyAsync(last_rows_.data(), saved.offsets.data() + experts_, sizeof(int32_t),
                                      cudaMemcpyDeviceToDevice, s));
    publish_status(control_.data(), status_.local<core::MegakernelStatus>(), s);
    barrier(s);
    combine_tokens(scratch.combine, in.topk_weights.as<float>(),
                   shape_.has_shared() ? scratch.shared_out.data() : nullptr, out.as<bf16>(), nullptr, T, k, H, s);
    clock.mark("combine", s);
    scratch.own_combine.release();
    if (!backward_is_resident()) {  // the backward recomputes g and u
      for (DeviceArray<bf16>* a : {&saved.shared_gate, &saved.shared_up}) a->release();
    } else if (!saved.by_slot) {  // the kernel's grouped rows become the context's
      saved.gate = std::move(scratch.ring_gate);
      saved.up = std::move(scratch.ring_up);
    }
    for (DeviceArray<bf16>* a : {&scratch.ring_gate, &scratch.ring_up}) a->release();
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
  // EP > 1: the symmetric x buffers; null at EP = 1, where dispatch reads the call's own x.
  bf16* const* x_peers() const { return x_ ? x_->peers<bf16>() : nullptr; }
  bf16* x_local() const { return x_ ? x_->local<bf16>() : nullptr; }
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
    saved.ring_rows = plan.ring_rows;
    saved.slots = world_ * T * shape_.top_k;
    saved.by_slot = backward_is_resident() && core::saves_rows_by_slot(saved.ring_rows, saved.slots);
    if (saved.by_slot) {
      saved.gate = DeviceArray<bf16>(size_t(saved.slots * shape_.intermediate), allocator_, s);
      saved.up = DeviceArray<bf16>(size_t(saved.slots * shape_.intermediate), allocator_, s);
    }
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
  // plan: the ring's x, g, u (not where the context keeps them by slot) and hidden rows, at EP > 1
  // its y rows (at EP = 1 the down tiles store y into the combine slots: y_by_slot), the shared
  // expert's hidden and output, and at EP = 1 the combine slots. At EP = 1 dispatch and
  // the shared expert read the caller's x in place (a one-entry table beside the combine slots';
  // no copy and no x buffer of the layer's), or a copy of it where its base is not 16-byte
  // aligned (the row copies and TMA need that).
  struct ForwardScratch {
    DeviceArray<bf16> ring_x, ring_gate, ring_up, ring_hidden, ring_y, shared_hidden, shared_out, own_combine, own_x;
    bf16* combine = nullptr;
    const bf16* x_local = nullptr;
    bf16* const* x_peers = nullptr;
    bf16* const* combine_peers = nullptr;
    ForwardScratch(const CudaMegakernelForward& f, const core::MegakernelPlan& plan, int64_t T, const bf16* x,
                   bool gate_up_by_slot, cudaStream_t s) {
      const MoeShape& sh = f.shape_;
      ring_x = DeviceArray<bf16>(size_t(plan.ring_rows * sh.hidden), f.allocator_, s);
      if (!gate_up_by_slot) {
        ring_gate = DeviceArray<bf16>(size_t(plan.ring_rows * sh.intermediate), f.allocator_, s);
        ring_up = DeviceArray<bf16>(size_t(plan.ring_rows * sh.intermediate), f.allocator_, s);
      }
      ring_hidden = DeviceArray<bf16>(size_t(plan.ring_rows * sh.intermediate), f.allocator_, s);
      if (sh.has_shared()) {
        shared_hidden = DeviceArray<bf16>(size_t(T * sh.shared_intermediate), f.allocator_, s);
        shared_out = DeviceArray<bf16>(size_t(T * sh.hidden), f.allocator_, s);
      }
      if (f.combine_) {
        ring_y = DeviceArray<bf16>(size_t(plan.ring_rows * sh.hidden), f.allocator_, s);
        combine = f.combine_->local<bf16>();
        combine_peers = f.combine_->peers<bf16>();
        x_local = f.x_->local<bf16>();
        x_peers = f.x_->peers<bf16>();
        return;
      }
      own_combine = DeviceArray<bf16>(size_t(T * sh.top_k * sh.hidden), f.allocator_, s);
      combine = own_combine.data();
      x_local = x;
      if (reinterpret_cast<uintptr_t>(x) % 16 != 0) {
        own_x = DeviceArray<bf16>(size_t(T * sh.hidden), f.allocator_, s);
        MOKA_CUDA_CHECK(cudaMemcpyAsync(own_x.data(), x, T * sh.hidden * sizeof(bf16), cudaMemcpyDeviceToDevice, s));
        x_local = own_x.data();
      }
      // Dispatch reads x through a one-entry table (the combine reads nothing: y_by_slot).
      PointerValues table;
      table.at[0] = x_local;
      table.count = 1;
      write_pointer_table(f.own_tables_.data(), table, s);
      x_peers = reinterpret_cast<bf16* const*>(f.own_tables_.data());
    }
  };

  MegakernelLaunch launch(const core::MegakernelPlan& plan, int64_t T, const MoeWeights& w,
                          const ForwardScratch& scratch, const ForwardSaved& saved) const {
    MegakernelLaunch l = sized_launch(plan, shape_, config_, T, experts_, num_sms_);
    l.num_comm_ctas = config_.num_comm_sms;
    l.offsets = saved.offsets.data();
    l.slot_of_row = saved.slot_of_row.data();
    l.x_peers = scratch.x_peers;
    l.combine_peers = scratch.combine_peers;
    l.x_local = scratch.x_local;
    l.w_gate = w.w_gate.as<bf16>();
    l.w_up = w.w_up.as<bf16>();
    l.w_down = w.w_down.as<bf16>();
    if (shape_.has_shared()) {
      l.ws_gate = w.ws_gate.as<bf16>();
      l.ws_up = w.ws_up.as<bf16>();
      l.ws_down = w.ws_down.as<bf16>();
    }
    l.ring_x = scratch.ring_x.data();
    l.ring_gate = scratch.ring_gate.data();
    l.ring_up = scratch.ring_up.data();
    if (saved.by_slot) {
      l.gate_by_slot = saved.gate.data();
      l.up_by_slot = saved.up.data();
    }
    l.ring_hidden = scratch.ring_hidden.data();
    l.ring_y = scratch.ring_y.data();
    if (world_ == 1) l.y_by_slot = scratch.combine;
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
  std::unique_ptr<SymmetricBuffers> x_;  // EP > 1 (the pulls' sources); EP = 1: the call's own x
  SymmetricBuffers routing_;
  std::unique_ptr<SymmetricBuffers> combine_;  // EP > 1 (the pushes' targets); EP = 1: each call's
  SymmetricBuffers status_;
  DeviceArray<int32_t> ids_, chunk_counts_, source_counts_, row_of_slot_;
  DeviceArray<int32_t> last_rows_{1};  // the last forward's grouped rows, while a timeline is recorded
  DeviceArray<void*> own_tables_{1};   // EP = 1: the call's x as a one-entry peer table
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

}  // namespace moka::cuda
