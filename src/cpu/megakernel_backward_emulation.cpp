// The backward megakernel on CPU threads. The host sequence mirrors what the GPU will do:
//   publish symmetric buffers (d_out, router weights, x; d_x slots and d_topk_weights to push
//   into) -> barrier (pull sources frozen) -> plan + segment table -> megakernel
//   -> barrier (pushes landed) -> collective error report
//   -> epilogue d_x = dx_shared + sum_j dx_slots[t*k+j], dW of experts without rows = 0.
// Inside the "kernel", workers only touch this rank's counters; other ranks' data is read
// (pulls) or written (pushes into unique slots) without cross-rank synchronization.
#include "cpu/megakernel_backward_emulation.hpp"

#include <algorithm>
#include <sstream>
#include <string>

#include "core/validate.hpp"
#include "cpu/expert_math.hpp"
#include "cpu/megakernel_threads.hpp"
#include "cpu/parallel.hpp"

namespace moka::cpu {
namespace {

using core::BackwardCounterKind;
using core::BackwardTask;
using core::BackwardTaskKind;
using core::ContextMode;
using core::MegakernelBackwardPlan;

// What a rank publishes: peers pull d_out rows, router weights and (replay) x rows, and push
// d_x rows ([T*k, H]) and d_topk_weights ([T*k]) into its slots.
template <typename T>
struct BackwardSymmetric {
  const T* d_out = nullptr;
  const T* x = nullptr;
  const T* topk_weights = nullptr;
  T* dx_slots = nullptr;
  T* dw_slots = nullptr;
};

// dgd of one row over columns [c0, c1) of I, in the reference's element order: dH = W_down^T
// d_out summed over H in order; h = act(g, u) with the forward's function (the forward's bits);
// (dg, du) = act'(g, u) (weight * dH). Returns the column tile's partial of <dH, h>.
template <typename T>
T dgd_row(const ExpertWeights<T>& w, ActivationSpec act, const T* g, const T* u, const T* d_out, T weight, int64_t c0,
          int64_t c1, T* dg, T* du, T* h) {
  const auto limit = static_cast<T>(act.limit);
  T partial = 0;
  for (int64_t i = c0; i < c1; ++i) {
    T dh = 0;
    for (int64_t o = 0; o < w.hidden; ++o) dh += w.down[o * w.intermediate + i] * d_out[o];
    h[i] = core::swiglu_forward<T>(g[i], u[i], act.clamped, limit);
    partial += dh * h[i];
    core::swiglu_backward<T>(g[i], u[i], weight * dh, act.clamped, limit, dg[i], du[i]);
  }
  return partial;
}

// dx of one row over columns [c0, c1) of H: one accumulator over K = I taking the gate and the
// up term of each k together, as the reference does.
template <typename T>
void dx_row(const ExpertWeights<T>& w, const T* dg, const T* du, int64_t c0, int64_t c1, T* dx) {
  for (int64_t c = c0; c < c1; ++c) {
    T acc = 0;
    for (int64_t i = 0; i < w.intermediate; ++i)
      acc += w.gate[i * w.hidden + c] * dg[i] + w.up[i * w.hidden + c] * du[i];
    dx[c] = acc;
  }
}

// The K rows of a weight-gradient tile, in order (row pointers into the ring or the context).
template <typename T>
struct WeightGradRows {
  std::vector<const T*> x, dg, du, d_out, h;
  std::vector<T> scale;  // the route weight (1 for the shared expert)
  void add(const T* x_row, const T* dg_row, const T* du_row, const T* d_out_row, const T* h_row, T weight) {
    x.push_back(x_row);
    dg.push_back(dg_row);
    du.push_back(du_row);
    d_out.push_back(d_out_row);
    h.push_back(h_row);
    scale.push_back(weight);
  }
};

// Where a weight-gradient tile starts from (`from`, or zero when null) and writes to: dW_gate
// and dW_up [I, H], dW_down [H, I]; a carry buffer holds the three in that order.
template <typename T>
struct WeightGradTarget {
  const T* from = nullptr;
  T *gate, *up, *down;
};

// Tile `tile` of the gradients of an expert with intermediate size I: the dW_gate|up tiles
// (tile_m rows of I by pair_tile_n columns of H, two accumulators sharing x) first, then the
// dW_down tiles (tile_m rows of H by tile_n columns of I). Each element sums its rows in order
// from the starting value, so a segment continuing a carry is one pass over all the rows.
template <typename T>
void weight_grad_tile(int64_t tile, int64_t H, int64_t I, int64_t tile_m, const core::BackwardTiling& tiling,
                      const WeightGradRows<T>& rows, const WeightGradTarget<T>& target) {
  const auto start = [&](int64_t offset) { return target.from ? target.from[offset] : T(0); };
  const int64_t pair_cols = core::ceil_div(H, tiling.pair_tile_n);
  const int64_t gate_up_tiles = core::ceil_div(I, tile_m) * pair_cols;
  const size_t n = rows.x.size();
  if (tile < gate_up_tiles) {
    const int64_t i0 = tile / pair_cols * tile_m, c0 = tile % pair_cols * tiling.pair_tile_n;
    for (int64_t i = i0; i < std::min(I, i0 + tile_m); ++i)
      for (int64_t c = c0; c < std::min(H, c0 + tiling.pair_tile_n); ++c) {
        T gate = start(i * H + c), up = start(I * H + i * H + c);
        for (size_t r = 0; r < n; ++r) {
          gate += rows.dg[r][i] * rows.x[r][c];
          up += rows.du[r][i] * rows.x[r][c];
        }
        target.gate[i * H + c] = gate;
        target.up[i * H + c] = up;
      }
    return;
  }
  tile -= gate_up_tiles;
  const int64_t i_cols = core::ceil_div(I, tiling.tile_n);
  const int64_t o0 = tile / i_cols * tile_m, i0 = tile % i_cols * tiling.tile_n;
  for (int64_t o = o0; o < std::min(H, o0 + tile_m); ++o)
    for (int64_t i = i0; i < std::min(I, i0 + tiling.tile_n); ++i) {
      T acc = start(2 * I * H + o * I + i);
      for (size_t r = 0; r < n; ++r) acc += (rows.scale[r] * rows.d_out[r][o]) * rows.h[r][i];
      target.down[o * I + i] = acc;
    }
}

template <typename T>
struct BackwardInputs {
  const MegakernelBackwardPlan& plan;
  core::SegmentTable segments;
  const MegakernelSavedState<T>& saved;
  const MoeShape& shape;
  const MoeWeights& weights;
  const T* x;      // this rank's tokens (shared expert)
  const T* d_out;  // this rank's d_out (shared expert)
  const std::vector<BackwardSymmetric<T>>& peers;
  const MoeGradients& grads;
  T* dx_shared;  // [T, H]
};

// One launch of the persistent kernel: workers take tickets until the task space is exhausted
// or a worker failed.
template <typename T>
class BackwardMegakernel {
 public:
  BackwardMegakernel(const BackwardInputs<T>& in, const MegakernelBackwardOptions& options, int rank)
      : in_(in), plan_(in.plan), options_(options), rank_(rank), H_(in.shape.hidden), I_(in.shape.intermediate),
        Is_(in.shape.shared_intermediate), k_(in.shape.top_k), act_(ActivationSpec::of(in.shape)),
        replay_(plan_.mode == ContextMode::replay), counters_(core::counter_count(plan_)) {
    const int64_t rows = plan_.ring_rows, tokens = plan_.tokens;
    ring_d_out_.assign(rows * H_, T(0));
    ring_weight_.assign(rows, T(0));
    ring_dx_.assign(rows * H_, T(0));
    for (auto* v : {&ring_dg_, &ring_du_, &ring_h_}) v->assign(rows * I_, T(0));
    ring_partials_.assign(rows * plan_.dgd_col_tiles, T(0));
    for (auto* v : {&shared_dg_, &shared_du_, &shared_h_}) v->assign(tokens * Is_, T(0));
    if (replay_) {
      ring_x_.assign(rows * H_, T(0));
      for (auto* v : {&ring_g_, &ring_u_}) v->assign(rows * I_, T(0));
      for (auto* v : {&shared_g_, &shared_u_}) v->assign(tokens * Is_, T(0));
    }
    carry_.assign(std::max<int64_t>(plan_.num_macrobatches - 1, 0) * core::carry_elements(plan_), T(0));
  }

  void run() {
    std::vector<std::jthread> workers;
    for (int i = 0; i < options_.config.num_comm_sms; ++i) workers.emplace_back([this] { work(true); });
    for (int i = 0; i < options_.num_compute_workers; ++i) workers.emplace_back([this] { work(false); });
  }

  // Empty when no worker failed.
  std::string failure() const { return failure_.status(); }
  std::vector<int64_t> counter_values() const { return cpu::counter_values(counters_); }

 private:
  void work(bool comm) {
    auto& ticket = comm ? comm_ticket_ : compute_ticket_;
    const int64_t count = comm ? core::comm_task_count(plan_) : core::compute_task_count(plan_, in_.segments);
    while (!failure_.failed()) {
      const int64_t t = ticket.fetch_add(1, std::memory_order_relaxed);
      if (t >= count) return;
      const BackwardTask task = comm ? core::comm_task(plan_, t) : core::compute_task(plan_, in_.segments, t);
      if (options_.before_task) options_.before_task(rank_, task);
      if (!wait(task)) return;
      if (task.step < 0 || task.kind == BackwardTaskKind::wgrad || core::task_has_rows(plan_, task)) execute(task);
      for (const auto& range : core::task_releases(plan_, in_.segments, task).range)
        for (int64_t at = range.first; at <= range.last && range.kind != BackwardCounterKind::none; ++at)
          counters_[core::counter_index(plan_, range.kind, at)].fetch_add(1, std::memory_order_release);
    }
  }

  bool wait(const BackwardTask& task) {
    const auto need = core::task_wait(plan_, in_.segments, task);
    if (need.kind == BackwardCounterKind::none) return true;
    const double timeout = options_.config.spin_timeout_seconds;
    return wait_for_counter(counters_[core::counter_index(plan_, need.kind, need.at)], need.target, timeout, failure_,
                            [&](int64_t seen) {
                              std::ostringstream os;
                              os << "megakernel backward: " << core::describe(plan_, task) << " timed out after "
                                 << timeout << " s waiting for " << core::to_string(need.kind) << " " << need.at
                                 << " to reach " << need.target << ", saw " << seen;
                              return os.str();
                            });
  }

  void execute(const BackwardTask& t) {
    switch (t.kind) {
      case BackwardTaskKind::pull: return for_rows(t, [&](int64_t row, int64_t ring) { pull_row(row, ring); });
      case BackwardTaskKind::push: return for_rows(t, [&](int64_t row, int64_t ring) { push_row(row, ring); });
      case BackwardTaskKind::gate_up: return gate_up(t);
      case BackwardTaskKind::dgd: return dgd(t);
      case BackwardTaskKind::dx: return dx(t);
      case BackwardTaskKind::wgrad: return wgrad(t);
      case BackwardTaskKind::shared_gate_up: return shared_gate_up(t);
      case BackwardTaskKind::shared_dgd: return shared_dgd(t);
      case BackwardTaskKind::shared_dx: return shared_dx(t);
      case BackwardTaskKind::shared_wgrad: return shared_wgrad(t);
      case BackwardTaskKind::none: return;
    }
  }

  // fn(grouped row, ring row) for the tile_m rows of a routed task.
  template <typename Fn>
  void for_rows(const BackwardTask& t, Fn&& fn) const {
    const int64_t first = core::task_first_row(plan_, t);
    for (int64_t row = first; row < first + plan_.tile_m; ++row) fn(row, core::ring_row(plan_, row));
  }
  // fn(token) for the tokens of a shared row tile (the last one may be partial).
  template <typename Fn>
  void for_tokens(const BackwardTask& t, Fn&& fn) const {
    const int64_t first = t.row_tile * plan_.tile_m;
    for (int64_t token = first; token < std::min(plan_.tokens, first + plan_.tile_m); ++token) fn(token);
  }
  // Columns [begin, end) of column tile `col` of width `tile` over `width` columns.
  static std::pair<int64_t, int64_t> columns(int64_t col, int64_t tile, int64_t width) {
    return {col * tile, std::min(width, (col + 1) * tile)};
  }
  ExpertWeights<T> routed(int64_t local_expert) const { return routed_expert<T>(in_.weights, in_.shape, local_expert); }
  ExpertWeights<T> expert_of(const BackwardTask& t) const {
    return routed(in_.saved.schedule.expert_of_row(core::task_first_row(plan_, t)));
  }
  ExpertWeights<T> shared() const { return shared_expert<T>(in_.weights, in_.shape); }

  // Pull: the row's d_out and route weight (replay: x) from its origin; padding rows are zero.
  void pull_row(int64_t row, int64_t ring) {
    const auto& schedule = in_.saved.schedule;
    const int source = schedule.row_source[row];
    T* d_out = &ring_d_out_[ring * H_];
    T* x = replay_ ? &ring_x_[ring * H_] : nullptr;
    if (source < 0) {
      std::fill(d_out, d_out + H_, T(0));
      if (x) std::fill(x, x + H_, T(0));
      ring_weight_[ring] = 0;
      return;
    }
    const int64_t slot = schedule.row_slot[row], token = slot / k_;
    const auto& peer = in_.peers[source];
    std::copy_n(peer.d_out + token * H_, H_, d_out);
    if (x) std::copy_n(peer.x + token * H_, H_, x);
    ring_weight_[ring] = peer.topk_weights[slot];
  }

  // Push: the d_x row to its origin slot, and d_topk_weights from the row's column-tile
  // partials summed in column order.
  void push_row(int64_t row, int64_t ring) {
    const auto& schedule = in_.saved.schedule;
    const int source = schedule.row_source[row];
    if (source < 0) return;
    const int64_t slot = schedule.row_slot[row];
    const auto& peer = in_.peers[source];
    std::copy_n(&ring_dx_[ring * H_], H_, peer.dx_slots + slot * H_);
    const T* partials = &ring_partials_[ring * plan_.dgd_col_tiles];
    T d_weight = partials[0];
    for (int64_t c = 1; c < plan_.dgd_col_tiles; ++c) d_weight += partials[c];
    peer.dw_slots[slot] = d_weight;
  }

  // Replay: g|u of the row tile's pulled x again (h is recomputed by dgd).
  void gate_up(const BackwardTask& t) {
    const auto [c0, c1] = columns(t.col_tile, plan_.pair_tile_n, I_);
    const auto w = gate_up_columns(expert_of(t), c0, c1);
    std::vector<T> h(c1 - c0);
    for_rows(t, [&](int64_t, int64_t ring) {
      gate_up_row(w, act_, &ring_x_[ring * H_], &ring_g_[ring * I_ + c0], &ring_u_[ring * I_ + c0], h.data());
    });
  }

  void dgd(const BackwardTask& t) {
    const auto [c0, c1] = columns(t.col_tile, plan_.tile_n, I_);
    const auto w = expert_of(t);
    for_rows(t, [&](int64_t row, int64_t ring) {
      // Resident: the forward's ring holds every row at its own index.
      const T* g = replay_ ? &ring_g_[ring * I_] : &in_.saved.ring_gate[row * I_];
      const T* u = replay_ ? &ring_u_[ring * I_] : &in_.saved.ring_up[row * I_];
      ring_partials_[ring * plan_.dgd_col_tiles + t.col_tile] =
          dgd_row(w, act_, g, u, &ring_d_out_[ring * H_], ring_weight_[ring], c0, c1, &ring_dg_[ring * I_],
                  &ring_du_[ring * I_], &ring_h_[ring * I_]);
    });
  }

  void dx(const BackwardTask& t) {
    const auto [c0, c1] = columns(t.col_tile, plan_.tile_n, H_);
    const auto w = expert_of(t);
    for_rows(t, [&](int64_t, int64_t ring) {
      dx_row(w, &ring_dg_[ring * I_], &ring_du_[ring * I_], c0, c1, &ring_dx_[ring * H_]);
    });
  }

  void wgrad(const BackwardTask& t) {
    const auto& segment = in_.segments.segments[t.segment];
    WeightGradRows<T> rows;
    for (int64_t row = segment.first_tile * plan_.tile_m; row < (segment.last_tile + 1) * plan_.tile_m; ++row) {
      const int64_t ring = core::ring_row(plan_, row);
      const T* x = replay_ ? &ring_x_[ring * H_] : &in_.saved.ring_x[row * H_];
      rows.add(x, &ring_dg_[ring * I_], &ring_du_[ring * I_], &ring_d_out_[ring * H_], &ring_h_[ring * I_],
               ring_weight_[ring]);
    }
    const int64_t carry = core::carry_elements(plan_), e = segment.expert;
    WeightGradTarget<T> target{nullptr, in_.grads.d_w_gate.template as<T>() + e * I_ * H_,
                               in_.grads.d_w_up.template as<T>() + e * I_ * H_,
                               in_.grads.d_w_down.template as<T>() + e * H_ * I_};
    if (segment.carry_in) target.from = &carry_[(core::macrobatch_of_tile(plan_, segment.first_tile) - 1) * carry];
    if (segment.carry_out) {
      T* next = &carry_[core::macrobatch_of_tile(plan_, segment.last_tile) * carry];
      target.gate = next;
      target.up = next + I_ * H_;
      target.down = next + 2 * I_ * H_;
    }
    weight_grad_tile(t.col_tile, H_, I_, plan_.tile_m, options_.tiling, rows, target);
  }

  void shared_gate_up(const BackwardTask& t) {
    const auto [c0, c1] = columns(t.col_tile, plan_.pair_tile_n, Is_);
    const auto w = gate_up_columns(shared(), c0, c1);
    std::vector<T> h(c1 - c0);
    for_tokens(t, [&](int64_t token) {
      const int64_t at = token * Is_ + c0;
      gate_up_row(w, act_, in_.x + token * H_, &shared_g_[at], &shared_u_[at], h.data());
    });
  }

  void shared_dgd(const BackwardTask& t) {
    const auto [c0, c1] = columns(t.col_tile, plan_.tile_n, Is_);
    const auto& g = replay_ ? shared_g_ : in_.saved.shared_gate;
    const auto& u = replay_ ? shared_u_ : in_.saved.shared_up;
    for_tokens(t, [&](int64_t token) {
      const int64_t at = token * Is_;
      dgd_row(shared(), act_, &g[at], &u[at], in_.d_out + token * H_, T(1), c0, c1, &shared_dg_[at], &shared_du_[at],
              &shared_h_[at]);
    });
  }

  void shared_dx(const BackwardTask& t) {
    const auto [c0, c1] = columns(t.col_tile, plan_.tile_n, H_);
    for_tokens(t, [&](int64_t token) {
      dx_row(shared(), &shared_dg_[token * Is_], &shared_du_[token * Is_], c0, c1, in_.dx_shared + token * H_);
    });
  }

  void shared_wgrad(const BackwardTask& t) {
    WeightGradRows<T> rows;
    for (int64_t token = 0; token < plan_.tokens; ++token)
      rows.add(in_.x + token * H_, &shared_dg_[token * Is_], &shared_du_[token * Is_], in_.d_out + token * H_,
               &shared_h_[token * Is_], T(1));
    const WeightGradTarget<T> target{nullptr, in_.grads.d_ws_gate.template as<T>(), in_.grads.d_ws_up.template as<T>(),
                                     in_.grads.d_ws_down.template as<T>()};
    weight_grad_tile(t.col_tile, H_, Is_, plan_.tile_m, options_.tiling, rows, target);
  }

  const BackwardInputs<T>& in_;
  const MegakernelBackwardPlan& plan_;
  const MegakernelBackwardOptions& options_;
  const int rank_;
  const int64_t H_, I_, Is_, k_;
  const ActivationSpec act_;
  const bool replay_;
  std::vector<std::atomic<int64_t>> counters_;
  // Ring buffers ([ring_rows, width]); x, g and u only in replay mode.
  std::vector<T> ring_d_out_, ring_weight_, ring_x_, ring_g_, ring_u_, ring_dg_, ring_du_, ring_h_, ring_partials_,
      ring_dx_;
  std::vector<T> carry_;  // one expert's three accumulators per macrobatch boundary
  std::vector<T> shared_g_, shared_u_, shared_dg_, shared_du_, shared_h_;  // [T, Is]
  std::atomic<int64_t> compute_ticket_{0}, comm_ticket_{0};
  FirstFailure<std::string> failure_;
};

// The backward's own checks, besides validate_emulation_inputs.
template <typename T>
void validate_backward(const MoeShape& shape, int world, int64_t tokens, const MegakernelSavedState<T>& saved,
                       const TensorView& d_out, const MoeGradients& grads, const MegakernelBackwardOptions& options) {
  expect_tensor(d_out, "d_out", emulated_dtype<T>(), Device::cpu(), {tokens, shape.hidden});
  core::validate_layer_gradients(shape, world, tokens, grads, emulated_dtype<T>(), Device::cpu());
  require(options.config.tile_rows == saved.plan.tile_m, ErrorCode::invalid_argument,
          "megakernel backward: tile_rows " + std::to_string(options.config.tile_rows) +
              " differs from the forward's " + std::to_string(saved.plan.tile_m) + " (the rows' padding)");
  require(saved.plan.tokens == tokens, ErrorCode::invalid_argument,
          "megakernel backward: the saved context is of " + std::to_string(saved.plan.tokens) + " tokens, x has " +
              std::to_string(tokens));
  require(options.mode == ContextMode::replay || saved.plan.num_macrobatches <= 1, ErrorCode::invalid_argument,
          "megakernel backward: resident mode reads every routed row's x, g and u from the forward's ring, which "
          "held " +
              std::to_string(saved.plan.ring_rows) + " of " + std::to_string(saved.plan.total_rows) +
              " rows (forward macrobatch_size " + std::to_string(saved.plan.macrobatch_rows) +
              "); use replay mode or a forward macrobatch_size >= the rows");
}

}  // namespace

template <typename T>
MegakernelBackwardResult megakernel_backward(ProcessGroup* group, const MoeShape& shape, const MoeInputs& in,
                                             const MoeWeights& weights, const MegakernelSavedState<T>& saved,
                                             const TensorView& d_out, const MoeGradients& grads,
                                             const MegakernelBackwardOptions& options) {
  validate_emulation_inputs<T>(group, shape, in, weights, options.config, options.num_compute_workers,
                               [&](int64_t tokens) {
                                 validate_backward(shape, world_of(group), tokens, saved, d_out, grads, options);
                               });
  const int world = world_of(group), rank = rank_of(group);
  const int64_t tokens = in.x.dim(0), H = shape.hidden, k = shape.top_k, slots = tokens * k;
  const int64_t local_experts = shape.num_experts / world;
  const core::MegakernelDims dims{world, tokens, k, H, shape.intermediate, shape.shared_intermediate, local_experts};
  const auto worst = core::build_backward_plan(options.config, {dims, options.mode, options.tiling});

  // Symmetric buffers, copied in so peers read buffers the layer owns until the end.
  const std::vector<T> d_out_symmetric(d_out.as<T>(), d_out.as<T>() + tokens * H);
  const std::vector<T> x_symmetric(in.x.as<T>(), in.x.as<T>() + tokens * H);
  const std::vector<T> weights_symmetric(in.topk_weights.as<T>(), in.topk_weights.as<T>() + slots);
  std::vector<T> dx_slots(slots * H, T(0)), dw_slots(slots, T(0));
  const auto peers = publish<BackwardSymmetric<T>>(group, {d_out_symmetric.data(), x_symmetric.data(),
                                                           weights_symmetric.data(), dx_slots.data(), dw_slots.data()});
  barrier(group);

  const int64_t rows = saved.schedule.total_rows();
  core::validate_collectively(group, layer_signature<T>(shape, tokens), [&] {
    require(core::fits_capacity(worst, rows), ErrorCode::capacity_exceeded,
            "megakernel backward: the receive schedule needs " + std::to_string(rows) + " rows but capacity is " +
                std::to_string(worst.capacity_rows) + "; raise capacity_multiplier");
  });
  MegakernelBackwardResult result;
  result.plan = core::backward_trim_to_rows(worst, rows);
  result.segments = core::build_segment_table(result.plan, saved.schedule.expert_offset);
  std::vector<T> dx_shared(shape.has_shared() ? tokens * H : 0);
  const BackwardInputs<T> kernel_in{result.plan,        result.segments.view(), saved, shape, weights,
                                    x_symmetric.data(), d_out_symmetric.data(), peers, grads, dx_shared.data()};
  BackwardMegakernel<T> kernel(kernel_in, options, rank);
  kernel.run();
  result.final_counters = kernel.counter_values();
  const std::string failure = kernel.failure();
  barrier(group);  // every push into this rank's slots has landed
  core::validate_collectively(group, layer_signature<T>(shape, tokens),
                              [&] { require(failure.empty(), ErrorCode::timeout, failure); });

  // d_x = dx_shared + sum_j dx_slots[t*k+j], j in order (unit weights keep the reference's bits).
  const std::vector<T> ones(k, T(1));
  T* d_x = grads.d_x.as<T>();
  parallel_for(tokens, options.num_compute_workers, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      weighted_sum_row(dx_shared.empty() ? nullptr : &dx_shared[t * H], ones.data(), &dx_slots[t * k * H], k, H,
                       d_x + t * H);
  });
  std::copy(dw_slots.begin(), dw_slots.end(), grads.d_topk_weights.as<T>());
  // Experts without rows have no weight-gradient task.
  const int64_t I = shape.intermediate;
  for (int64_t e = 0; e < local_experts; ++e)
    if (saved.schedule.expert_offset[e + 1] == saved.schedule.expert_offset[e])
      for (const auto* g : {&grads.d_w_gate, &grads.d_w_up, &grads.d_w_down})
        std::fill_n(g->template as<T>() + e * I * H, I * H, T(0));
  return result;
}

template MegakernelBackwardResult megakernel_backward<float>(ProcessGroup*, const MoeShape&, const MoeInputs&,
                                                             const MoeWeights&, const MegakernelSavedState<float>&,
                                                             const TensorView&, const MoeGradients&,
                                                             const MegakernelBackwardOptions&);
template MegakernelBackwardResult megakernel_backward<double>(ProcessGroup*, const MoeShape&, const MoeInputs&,
                                                              const MoeWeights&, const MegakernelSavedState<double>&,
                                                              const TensorView&, const MoeGradients&,
                                                              const MegakernelBackwardOptions&);

}  // namespace moka::cpu
