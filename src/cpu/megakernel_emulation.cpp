// The forward megakernel on CPU threads. The host sequence mirrors the GPU's:
//   publish symmetric buffers -> routing exchange into every peer -> barrier (pull sources frozen)
//   -> receive schedule + capacity check -> megakernel -> barrier (pushes landed)
//   -> collective error report -> epilogue out = shared + sum_j w_j * combine[t*k+j].
// Inside the "kernel", workers only ever touch this rank's counters: the data of other ranks is
// read (x) or written (combine slots) without any cross-rank synchronization, as on the GPU.
#include "cpu/megakernel_emulation.hpp"

#include <algorithm>
#include <cstring>

#include "core/validate.hpp"
#include "cpu/expert_math.hpp"
#include "cpu/megakernel_threads.hpp"
#include "cpu/parallel.hpp"

namespace moka::cpu {
namespace {

using core::CounterKind;
using core::CounterRef;
using core::MegakernelPlan;
using core::Task;
using core::TaskKind;

// What a rank publishes to its peers: peers pull x rows, write their routing into topk_ids
// ([EP][T*k]) and push expert outputs into combine ([T*k, H]).
template <typename T>
struct SymmetricAddresses {
  const T* x = nullptr;
  int32_t* topk_ids = nullptr;
  T* combine = nullptr;
};

template <typename T>
struct KernelInputs {
  const MegakernelPlan& plan;
  const core::ReceiveSchedule& schedule;
  const MoeShape& shape;
  const MoeWeights& weights;
  const T* x;                                       // this rank's tokens (shared expert)
  const std::vector<SymmetricAddresses<T>>& peers;  // [EP]
  T* shared_out;                                    // [T, H]
};

// One launch of the persistent kernel: workers take tickets until the task space is exhausted
// or the status word is set.
template <typename T>
class Megakernel {
 public:
  Megakernel(const KernelInputs<T>& in, MegakernelSavedState<T>& saved, const MegakernelEmulationOptions& options,
             int rank)
      : in_(in), plan_(in.plan), saved_(saved), options_(options), rank_(rank), H_(in.shape.hidden),
        I_(in.shape.intermediate), Is_(in.shape.shared_intermediate), k_(in.shape.top_k),
        act_(ActivationSpec::of(in.shape)), counters_(core::counter_count(plan_)), ring_y_(plan_.ring_rows * H_) {}

  void run() {
    std::vector<std::jthread> workers;
    for (int i = 0; i < options_.config.num_comm_sms; ++i)
      workers.emplace_back([this] { work(comm_ticket_, core::comm_task_count(plan_), core::comm_task); });
    for (int i = 0; i < options_.num_compute_workers; ++i)
      workers.emplace_back([this] { work(compute_ticket_, core::compute_task_count(plan_), core::compute_task); });
  }

  core::MegakernelStatus status() const { return status_.status(); }
  std::vector<int64_t> counter_values() const { return cpu::counter_values(counters_); }

 private:
  void work(std::atomic<int64_t>& ticket, int64_t task_count, Task (*decode)(const MegakernelPlan&, int64_t)) {
    while (!status_.failed()) {
      const int64_t t = ticket.fetch_add(1, std::memory_order_relaxed);
      if (t >= task_count) return;
      const Task task = decode(plan_, t);
      if (options_.before_task) options_.before_task(rank_, task);
      if (!wait(task, core::task_wait(plan_, task))) return;
      if (task.step < 0 || core::task_has_rows(plan_, task)) execute(task);
      release(core::task_release(plan_, task));
    }
  }

  bool wait(const Task& task, const CounterRef& need) {
    if (need.kind == CounterKind::none) return true;
    return wait_for_counter(
        counters_[core::counter_index(plan_, need)], need.target, options_.config.spin_timeout_seconds, status_,
        [&](int64_t seen) {
          const int64_t minibatch = task.step < 0 ? -1 : core::minibatch_of_step(plan_, task.step);
          return core::MegakernelStatus{
              core::StatusCode::timeout, task.kind, need.kind, minibatch, task.row_tile, need.target, seen, 0, 0};
        });
  }

  void release(const CounterRef& done) {
    if (done.kind != CounterKind::none)
      counters_[core::counter_index(plan_, done)].fetch_add(1, std::memory_order_release);
  }

  void execute(const Task& t) {
    switch (t.kind) {
      case TaskKind::shared_gate_up: return shared_gate_up(t);
      case TaskKind::shared_down: return shared_down(t);
      case TaskKind::dispatch: return for_rows(t, [&](int64_t row, int64_t ring) { pull_row(row, ring); });
      case TaskKind::gate_up: return gate_up(t);
      case TaskKind::down: return down(t);
      case TaskKind::combine: return for_rows(t, [&](int64_t row, int64_t ring) { push_row(row, ring); });
      case TaskKind::none: return;
    }
  }

  // fn(grouped row, ring row) for the tile_m rows of a routed task.
  template <typename Fn>
  void for_rows(const Task& t, Fn&& fn) const {
    const int64_t first = core::task_first_row(plan_, t);
    for (int64_t row = first; row < first + plan_.tile_m; ++row) fn(row, core::ring_row(plan_, row));
  }

  // Dispatch (pull): the row's token from its owner's x; padding rows are zero-filled.
  void pull_row(int64_t row, int64_t ring) {
    T* dst = &saved_.ring_x[ring * H_];
    const int source = in_.schedule.row_source[row];
    if (source < 0) {
      std::fill(dst, dst + H_, T(0));
      return;
    }
    const T* src = in_.peers[source].x + in_.schedule.row_slot[row] / k_ * H_;
    std::copy(src, src + H_, dst);
  }

  // Combine (push): the expert output into the origin rank's unique slot token*k + j.
  void push_row(int64_t row, int64_t ring) {
    const int source = in_.schedule.row_source[row];
    if (source < 0) return;
    const T* src = &ring_y_[ring * H_];
    std::copy(src, src + H_, in_.peers[source].combine + in_.schedule.row_slot[row] * H_);
  }

  // Columns [begin, end) of an N tile `tile_n` wide over `width` columns.
  std::pair<int64_t, int64_t> columns(const Task& t, int64_t tile_n, int64_t width) const {
    const int64_t begin = t.col_tile * tile_n;
    return {begin, std::min(width, begin + tile_n)};
  }
  // Tiles never span two experts: each expert's segment is padded to tile_m.
  ExpertWeights<T> expert_of(const Task& t) const {
    return routed_expert<T>(in_.weights, in_.shape, in_.schedule.expert_of_row(core::task_first_row(plan_, t)));
  }

  void gate_up(const Task& t) {
    const auto [c0, c1] = columns(t, plan_.tile_n, I_);
    const auto w = gate_up_columns(expert_of(t), c0, c1);
    for_rows(t, [&](int64_t, int64_t ring) {
      const int64_t out = ring * I_ + c0;
      gate_up_row(w, act_, &saved_.ring_x[ring * H_], &saved_.ring_gate[out], &saved_.ring_up[out],
                  &saved_.ring_hidden[out]);
    });
  }

  void down(const Task& t) {
    const auto [c0, c1] = columns(t, plan_.down_tile_n, H_);
    const auto w = down_columns(expert_of(t), c0, c1);
    for_rows(t, [&](int64_t, int64_t ring) { down_row(w, &saved_.ring_hidden[ring * I_], &ring_y_[ring * H_ + c0]); });
  }

  // fn(token) for the tokens of a shared-expert row tile (the last one may be partial).
  template <typename Fn>
  void for_tokens(const Task& t, Fn&& fn) const {
    const int64_t first = t.row_tile * plan_.tile_m;
    for (int64_t token = first; token < std::min(plan_.tokens, first + plan_.tile_m); ++token) fn(token);
  }

  void shared_gate_up(const Task& t) {
    const auto [c0, c1] = columns(t, plan_.tile_n, Is_);
    const auto w = gate_up_columns(shared_expert<T>(in_.weights, in_.shape), c0, c1);
    for_tokens(t, [&](int64_t token) {
      const int64_t out = token * Is_ + c0;
      gate_up_row(w, act_, in_.x + token * H_, &saved_.shared_gate[out], &saved_.shared_up[out],
                  &saved_.shared_hidden[out]);
    });
  }

  void shared_down(const Task& t) {
    const auto [c0, c1] = columns(t, plan_.down_tile_n, H_);
    const auto w = down_columns(shared_expert<T>(in_.weights, in_.shape), c0, c1);
    for_tokens(t, [&](int64_t token) {
      down_row(w, &saved_.shared_hidden[token * Is_], in_.shared_out + token * H_ + c0);
    });
  }

  const KernelInputs<T>& in_;
  const MegakernelPlan& plan_;
  MegakernelSavedState<T>& saved_;
  const MegakernelEmulationOptions& options_;
  const int rank_;
  const int64_t H_, I_, Is_, k_;
  const ActivationSpec act_;
  std::vector<std::atomic<int64_t>> counters_;
  std::vector<T> ring_y_;  // expert outputs, read by combine; not saved (backward recomputes d_w without y)
  std::atomic<int64_t> compute_ticket_{0}, comm_ticket_{0};
  FirstFailure<core::MegakernelStatus> status_;
};

}  // namespace

template <typename T>
MegakernelForwardResult<T> megakernel_forward(ProcessGroup* group, const MoeShape& shape, const MoeInputs& in,
                                              const MoeWeights& weights, const TensorView& out,
                                              const MegakernelEmulationOptions& options) {
  validate_emulation_inputs<T>(group, shape, in, weights, options.config, options.num_compute_workers,
                               [&](int64_t tokens) {
                                 expect_tensor(out, "out", emulated_dtype<T>(), Device::cpu(), {tokens, shape.hidden});
                               });
  const int world = world_of(group), rank = rank_of(group);
  const int64_t tokens = in.x.dim(0), H = shape.hidden, k = shape.top_k, slots = tokens * k;
  const int64_t local_experts = shape.num_experts / world;
  const auto worst = core::build_megakernel_plan(options.config, {world, tokens, k, H, shape.intermediate,
                                                                  shape.shared_intermediate, local_experts});

  // Symmetric buffers; x is copied in so peers read a buffer the layer owns until the end.
  std::vector<T> x_symmetric(in.x.as<T>(), in.x.as<T>() + tokens * H);
  std::vector<int32_t> ids_symmetric(world * slots);
  std::vector<T> combine(slots * H, T(0));
  const auto peers = publish<SymmetricAddresses<T>>(group, {x_symmetric.data(), ids_symmetric.data(), combine.data()});
  // Routing exchange: every rank writes its ids into every peer's buffer.
  for (const auto& peer : peers) std::copy_n(in.topk_ids.as<int32_t>(), slots, peer.topk_ids + rank * slots);
  barrier(group);

  MegakernelForwardResult<T> result;
  auto& saved = result.saved;
  saved.schedule = core::build_receive_schedule({world, tokens, k, local_experts, rank * local_experts, worst.tile_m,
                                                 options.config.row_order, rank},
                                                ids_symmetric.data());
  core::MegakernelStatus status;
  saved.plan = core::trim_to_rows(worst, saved.schedule.total_rows());
  std::vector<T> shared_out(shape.has_shared() ? tokens * H : 0);
  if (core::fits_capacity(worst, saved.schedule.total_rows())) {
    const int64_t I = shape.intermediate, Is = shape.shared_intermediate, ring = saved.plan.ring_rows;
    saved.ring_x.assign(ring * H, T(0));
    for (auto* v : {&saved.ring_gate, &saved.ring_up, &saved.ring_hidden}) v->assign(ring * I, T(0));
    for (auto* v : {&saved.shared_gate, &saved.shared_up, &saved.shared_hidden}) v->assign(tokens * Is, T(0));
    const KernelInputs<T> kernel_in{saved.plan, saved.schedule, shape, weights, in.x.as<T>(), peers, shared_out.data()};
    Megakernel<T> kernel(kernel_in, saved, options, rank);
    kernel.run();
    status = kernel.status();
    result.final_counters = kernel.counter_values();
  } else {
    status = {core::StatusCode::capacity_exceeded, TaskKind::none,     CounterKind::none, -1, 0, 0, 0,
              saved.schedule.total_rows(),         worst.capacity_rows};
  }
  barrier(group);  // every push into this rank's combine buffer has landed
  core::validate_collectively(group, layer_signature<T>(shape, tokens),
                              [&] { core::throw_megakernel_status(status, options.config); });

  const T* router_weights = in.topk_weights.as<T>();
  T* y = out.as<T>();
  parallel_for(tokens, options.num_compute_workers, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      weighted_sum_row(shared_out.empty() ? nullptr : &shared_out[t * H], router_weights + t * k, &combine[t * k * H],
                       k, H, y + t * H);
  });
  return result;
}

template MegakernelForwardResult<float> megakernel_forward<float>(ProcessGroup*, const MoeShape&, const MoeInputs&,
                                                                  const MoeWeights&, const TensorView&,
                                                                  const MegakernelEmulationOptions&);
template MegakernelForwardResult<double> megakernel_forward<double>(ProcessGroup*, const MoeShape&, const MoeInputs&,
                                                                    const MoeWeights&, const TensorView&,
                                                                    const MegakernelEmulationOptions&);

}  // namespace moka::cpu
