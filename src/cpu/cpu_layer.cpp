// The CPU reference MoE layer. Its stages mirror the GPU path one for one:
//   routing exchange -> receive schedule -> dispatch -> gate/up + activation -> down
//   -> combine (rows back to their origin slot token*k+j) -> epilogue (shared + sum_j w_j y_j).
// Every rank of an emulated group runs this on its own thread; rows move only through the
// group's collectives, in the order the schedule defines. With LayerOptions::precision = fp8 the
// experts' GEMMs (forward, dgrad, wgrad; shared expert included) are the FP8 recipe's emulation
// (Fp8Expert in expert_math.hpp, fp8_weight_grads), every other stage the same code.
#include "cpu/cpu_layer.hpp"

#include <algorithm>
#include <cstring>

#include "core/schedule.hpp"
#include "core/validate.hpp"
#include "cpu/expert_math.hpp"
#include "cpu/parallel.hpp"

namespace moka::cpu {
namespace {

using core::ReceiveSchedule;
using core::SendPlan;

template <typename T>
struct CpuContext final : MoeContext {
  int64_t tokens = 0;
  std::vector<int32_t> all_ids;  // [R][T*k]
  std::vector<T> all_weights;    // [R][T*k]
  ReceiveSchedule schedule;
  SendPlan send_plan;
  std::vector<std::vector<int64_t>> rows_by_source;
  std::vector<T> x_grouped, gate, up, hidden;            // [rows, H] / [rows, I]
  std::vector<T> shared_gate, shared_up, shared_hidden;  // [T, Is]
  const T* x = nullptr;  // the caller's x, which must outlive backward (as autograd keeps it)

  std::vector<int64_t> local_expert_rows() const override { return schedule.expert_rows; }
};

// Moves per-row payloads between ranks along the routing: `forward` sends rows from each
// source's slots to the receivers' grouped rows (dispatch); `backward` returns grouped rows to
// their origin slots (combine). `width` values per row.
template <typename T>
class RowExchange {
 public:
  RowExchange(ProcessGroup* group, const CpuContext<T>& ctx) : group_(group), ctx_(ctx) {}

  // dst_grouped[row] = src_slots[slot]; padding rows are left as they are.
  void dispatch(const T* src_slots, int64_t width, T* dst_grouped) const {
    const auto& plan = ctx_.send_plan;
    std::vector<T> send(plan.slots.size() * width);
    for (size_t n = 0; n < plan.slots.size(); ++n)
      std::memcpy(&send[n * width], src_slots + plan.slots[n] * width, width * sizeof(T));
    std::vector<T> recv(received_rows() * width);
    exchange(send, plan_counts(), recv, source_counts(), width);
    int64_t n = 0;
    for (const auto& rows : ctx_.rows_by_source)
      for (int64_t row : rows) std::memcpy(dst_grouped + row * width, &recv[(n++) * width], width * sizeof(T));
  }

  // dst_slots[slot] = src_grouped[row] for every routed row.
  void combine(const T* src_grouped, int64_t width, T* dst_slots) const {
    std::vector<T> send(received_rows() * width);
    int64_t n = 0;
    for (const auto& rows : ctx_.rows_by_source)
      for (int64_t row : rows) std::memcpy(&send[(n++) * width], src_grouped + row * width, width * sizeof(T));
    const auto& plan = ctx_.send_plan;
    std::vector<T> recv(plan.slots.size() * width);
    exchange(send, source_counts(), recv, plan_counts(), width);
    for (size_t m = 0; m < plan.slots.size(); ++m)
      std::memcpy(dst_slots + plan.slots[m] * width, &recv[m * width], width * sizeof(T));
  }

 private:
  int world() const { return group_ ? group_->size() : 1; }
  int64_t received_rows() const {
    int64_t n = 0;
    for (const auto& rows : ctx_.rows_by_source) n += static_cast<int64_t>(rows.size());
    return n;
  }
  std::vector<int64_t> plan_counts() const {
    std::vector<int64_t> c(world());
    for (int p = 0; p < world(); ++p) c[p] = ctx_.send_plan.rank_offset[p + 1] - ctx_.send_plan.rank_offset[p];
    return c;
  }
  std::vector<int64_t> source_counts() const {
    std::vector<int64_t> c(world());
    for (int p = 0; p < world(); ++p) c[p] = static_cast<int64_t>(ctx_.rows_by_source[p].size());
    return c;
  }
  void exchange(const std::vector<T>& send, const std::vector<int64_t>& send_rows, std::vector<T>& recv,
                const std::vector<int64_t>& recv_rows, int64_t width) const {
    if (!group_ || group_->size() == 1) {
      std::copy(send.begin(), send.end(), recv.begin());
      return;
    }
    const int R = world();
    std::vector<size_t> sb(R), so(R), rb(R), ro(R);
    size_t s_off = 0, r_off = 0;
    for (int p = 0; p < R; ++p) {
      sb[p] = send_rows[p] * width * sizeof(T);
      rb[p] = recv_rows[p] * width * sizeof(T);
      so[p] = s_off;
      ro[p] = r_off;
      s_off += sb[p];
      r_off += rb[p];
    }
    group_->all_to_all_v(send.data(), sb.data(), so.data(), recv.data(), rb.data(), ro.data());
  }

  ProcessGroup* group_;
  const CpuContext<T>& ctx_;
};

template <typename T>
class CpuMoeLayer final : public MoeLayer {
 public:
  CpuMoeLayer(const MoeShape& shape, ProcessGroup* group, const LayerOptions& options)
      : shape_(shape), group_(group), options_(options),
        threads_(resolve_threads(options.num_threads, group ? group->size() : 1)) {
    core::validate_shape(shape_, world_size());
    require(options_.tile_rows >= 1, ErrorCode::invalid_argument, "tile_rows must be >= 1");
  }

  const MoeShape& shape() const override { return shape_; }
  int rank() const override { return group_ ? group_->rank() : 0; }
  int world_size() const override { return group_ ? group_->size() : 1; }
  const char* backend_name() const override { return "cpu"; }

  std::unique_ptr<MoeContext> forward(const MoeInputs& in, const MoeWeights& w, const TensorView& out,
                                      Stream) override {
    const DType dt = dtype();
    const int64_t T_ = in.x.rank == 2 ? in.x.dim(0) : 0;
    core::validate_collectively(group_, signature(T_), [&] {
      core::validate_layer_tensors(shape_, world_size(), in, w, dt, Device::cpu());
      expect_tensor(out, "out", dt, Device::cpu(), {T_, shape_.hidden});
      core::validate_routing(in.topk_ids.as<int32_t>(), in.topk_weights.as<T>(), T_, shape_.top_k, shape_.num_experts);
    });
    auto ctx = std::make_unique<CpuContext<T>>();
    ctx->tokens = T_;
    ctx->x = in.x.as<T>();
    exchange_routing(in, *ctx);
    build_schedule(*ctx);
    const int64_t H = shape_.hidden, I = shape_.intermediate;
    const int64_t rows = ctx->schedule.total_rows();

    ctx->x_grouped.assign(rows * H, T(0));
    RowExchange<T>(group_, *ctx).dispatch(expand_tokens_to_slots(ctx->x, T_).data(), H, ctx->x_grouped.data());
    ctx->gate.assign(rows * I, T(0));
    ctx->up.assign(rows * I, T(0));
    ctx->hidden.assign(rows * I, T(0));
    std::vector<T> y(rows * H, T(0)), shared_out;
    with_gemms(w, [&](const auto& experts, const auto& shared) {
      experts_forward(*ctx, experts, y.data());
      if (shape_.has_shared()) shared_out = shared_forward(*ctx, shared);
    });

    std::vector<T> combined(T_ * shape_.top_k * H, T(0));
    RowExchange<T>(group_, *ctx).combine(y.data(), H, combined.data());
    combine_epilogue(*ctx, in.topk_weights.as<T>(), combined.data(), shared_out, out.as<T>());
    return ctx;
  }

  void backward(const MoeContext& saved, const TensorView& d_out_view, const MoeWeights& w, const MoeGradients& g,
                Stream) override {
    const auto* ctx_ptr = dynamic_cast<const CpuContext<T>*>(&saved);
    require(ctx_ptr != nullptr, ErrorCode::invalid_argument, "backward got a context from another layer type");
    const auto& ctx = *ctx_ptr;
    const int64_t T_ = ctx.tokens, H = shape_.hidden, I = shape_.intermediate, k = shape_.top_k;
    const DType dt = dtype();
    core::validate_collectively(group_, signature(T_), [&] {
      expect_tensor(d_out_view, "d_out", dt, Device::cpu(), {T_, H});
      core::validate_layer_gradients(shape_, world_size(), T_, g, dt, Device::cpu());
    });
    const T* d_out = d_out_view.as<T>();
    const int64_t rows = ctx.schedule.total_rows();

    // Dispatch d_out (unscaled) to the expert rows, like x in forward.
    std::vector<T> d_out_grouped(rows * H, T(0));
    RowExchange<T>(group_, ctx).dispatch(expand_tokens_to_slots(d_out, T_).data(), H, d_out_grouped.data());
    std::vector<T> route_weight(rows, T(0)), d_weight(rows, T(0));
    for (int64_t r = 0; r < rows; ++r)
      if (ctx.schedule.row_source[r] >= 0)
        route_weight[r] = ctx.all_weights[ctx.schedule.row_source[r] * T_ * k + ctx.schedule.row_slot[r]];

    std::vector<T> dg(rows * I, T(0)), du(rows * I, T(0)), dx_grouped(rows * H, T(0)), dx_shared;
    with_gemms(w, [&](const auto& experts, const auto& shared) {
      experts_backward_rows(ctx, experts, d_out_grouped.data(), route_weight.data(), dg.data(), du.data(),
                            dx_grouped.data(), d_weight.data());
      if (shape_.has_shared()) dx_shared = shared_backward(ctx, shared, d_out, g);
    });
    experts_weight_grads(ctx, d_out_grouped.data(), route_weight.data(), dg.data(), du.data(), g);

    // Combine: d_x rows and d_weight scalars back to their origin slots.
    std::vector<T> dx_slots(T_ * k * H, T(0)), dw_slots(T_ * k, T(0));
    RowExchange<T>(group_, ctx).combine(dx_grouped.data(), H, dx_slots.data());
    RowExchange<T>(group_, ctx).combine(d_weight.data(), 1, dw_slots.data());

    T* d_x = g.d_x.as<T>();
    parallel_for(T_, threads_, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        for (int64_t c = 0; c < H; ++c) {
          T acc = dx_shared.empty() ? T(0) : dx_shared[t * H + c];
          for (int64_t j = 0; j < k; ++j) acc += dx_slots[(t * k + j) * H + c];
          d_x[t * H + c] = acc;
        }
      }
    });
    std::copy(dw_slots.begin(), dw_slots.end(), g.d_topk_weights.as<T>());
  }

 private:
  static DType dtype() { return std::is_same_v<T, double> ? DType::f64 : DType::f32; }
  core::LayerSignature signature(int64_t tokens) const { return core::layer_signature(shape_, tokens, dtype()); }

  // Calls fn(experts, shared): the local experts' and the shared expert's products (expert_math.hpp)
  // in the layer's precision: on the weights as given, or on their 128x128-block quantization in
  // both orientations, made at each call (the GPU layer is to make it once per optimizer step).
  template <typename Fn>
  void with_gemms(const MoeWeights& w, Fn&& fn) const {
    const int64_t E = num_local_experts();
    std::vector<ExpertWeights<T>> experts;
    for (int64_t e = 0; e < E; ++e) experts.push_back(routed_expert<T>(w, shape_, e));
    const ExpertWeights<T> shared = shape_.has_shared() ? shared_expert<T>(w, shape_) : ExpertWeights<T>{};
    if (options_.precision == Precision::bf16) return fn(experts, shared);
    std::vector<Fp8Expert> quantized(E);
    parallel_for(E, threads_, [&](int64_t b, int64_t end) {
      for (int64_t e = b; e < end; ++e) quantized[e] = Fp8Expert::of(experts[e]);
    });
    fn(quantized, shape_.has_shared() ? Fp8Expert::of(shared) : Fp8Expert{});
  }

  // Routing exchange: every rank learns every rank's ids and weights (the GPU path writes them
  // into each peer's symmetric buffer).
  void exchange_routing(const MoeInputs& in, CpuContext<T>& ctx) const {
    const int64_t slots = ctx.tokens * shape_.top_k;
    ctx.all_ids.resize(world_size() * slots);
    ctx.all_weights.resize(world_size() * slots);
    if (world_size() == 1) {
      // copy_n, not memcpy: with zero tokens both pointers may be null, which memcpy forbids.
      std::copy_n(in.topk_ids.as<int32_t>(), slots, ctx.all_ids.data());
      std::copy_n(in.topk_weights.as<T>(), slots, ctx.all_weights.data());
      return;
    }
    group_->all_gather(in.topk_ids.data, ctx.all_ids.data(), slots * sizeof(int32_t));
    group_->all_gather(in.topk_weights.data, ctx.all_weights.data(), slots * sizeof(T));
  }

  void build_schedule(CpuContext<T>& ctx) const {
    core::ScheduleDims dims{world_size(),         ctx.tokens,         shape_.top_k,       num_local_experts(),
                            first_local_expert(), options_.tile_rows, options_.row_order, rank()};
    ctx.schedule = core::build_receive_schedule(dims, ctx.all_ids.data());
    ctx.send_plan = core::build_send_plan(ctx.all_ids.data() + rank() * ctx.tokens * shape_.top_k, ctx.tokens,
                                          shape_.top_k, shape_.num_experts, world_size());
    ctx.rows_by_source = core::rows_by_source(ctx.schedule);
  }

  // The per-slot view of a per-token tensor (slot token*k+j holds token's row), so dispatch
  // reads from slots like the GPU's `x[slot / k]` addressing. The call's own buffer: a layer
  // holds no state between or across calls, so threads may share it.
  std::vector<T> expand_tokens_to_slots(const T* tokens, int64_t T_) const {
    const int64_t H = shape_.hidden, k = shape_.top_k;
    std::vector<T> slots(T_ * k * H);
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t j = 0; j < k; ++j) std::memcpy(&slots[(t * k + j) * H], tokens + t * H, H * sizeof(T));
    return slots;
  }

  template <typename Fn>
  void for_routed_rows(const CpuContext<T>& ctx, Fn&& fn) const {
    const auto& s = ctx.schedule;
    parallel_for(s.total_rows(), threads_, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        if (s.row_source[r] >= 0) fn(r, s.expert_of_row(r));
    });
  }

  template <typename W>
  void experts_forward(CpuContext<T>& ctx, const std::vector<W>& experts, T* y) const {
    const int64_t H = shape_.hidden, I = shape_.intermediate;
    const auto act = ActivationSpec::of(shape_);
    for_routed_rows(ctx, [&](int64_t r, int64_t e) {
      const W& ew = experts[e];
      gate_up_row(ew, act, &ctx.x_grouped[r * H], &ctx.gate[r * I], &ctx.up[r * I], &ctx.hidden[r * I]);
      down_row(ew, &ctx.hidden[r * I], y + r * H);
    });
  }

  template <typename W>
  void experts_backward_rows(const CpuContext<T>& ctx, const std::vector<W>& experts, const T* d_out_grouped,
                             const T* route_weight, T* dg, T* du, T* dx, T* d_weight) const {
    const int64_t H = shape_.hidden, I = shape_.intermediate;
    const auto act = ActivationSpec::of(shape_);
    for_routed_rows(ctx, [&](int64_t r, int64_t e) {
      std::vector<T> dh(I);
      d_weight[r] = backward_row(experts[e], act, &ctx.gate[r * I], &ctx.up[r * I], &ctx.hidden[r * I],
                                 d_out_grouped + r * H, route_weight[r], dh.data(), dg + r * I, du + r * I, dx + r * H);
    });
  }

  // dW per local expert over its rows in canonical (source, slot) order: bitwise independent of
  // how many ranks the experts are split over. Empty experts get exact zeros.
  void experts_weight_grads(const CpuContext<T>& ctx, const T* d_out_grouped, const T* route_weight, const T* dg,
                            const T* du, const MoeGradients& g) const {
    const int64_t H = shape_.hidden, I = shape_.intermediate, E = num_local_experts();
    if (options_.precision == Precision::fp8) {
      for (int64_t e = 0; e < E; ++e)
        fp8_weight_grads(ctx.schedule.canonical_rows[e], ctx.x_grouped.data(), dg, du, d_out_grouped, route_weight,
                         ctx.hidden.data(), I, g.d_w_gate.as<T>() + e * I * H, g.d_w_up.as<T>() + e * I * H,
                         g.d_w_down.as<T>() + e * H * I);
      return;
    }
    // Work items: (expert, gate/up row i) and (expert, down row o).
    parallel_for(E * (I + H), threads_, [&](int64_t b, int64_t end) {
      for (int64_t item = b; item < end; ++item) {
        const int64_t e = item / (I + H), q = item % (I + H);
        const auto& rows = ctx.schedule.canonical_rows[e];
        if (q < I) {
          gate_up_weight_grad_rows(rows, dg, du, ctx.x_grouped.data(), H, I, q, q + 1, g.d_w_gate.as<T>() + e * I * H,
                                   g.d_w_up.as<T>() + e * I * H);
        } else {
          down_weight_grad_rows(rows, route_weight, d_out_grouped, ctx.hidden.data(), H, I, q - I, q - I + 1,
                                g.d_w_down.as<T>() + e * H * I);
        }
      }
    });
  }

  // The wgrad GEMMs of one expert under the FP8 recipe over `rows` (canonical order; fp8_gemm.hpp):
  // dW_gate = dG^T x, dW_up = dU^T x, dW_down = d_out^T (w h), every operand the K-major copy of
  // its rows quantized 1x128 along them. No rows: exact zeros.
  void fp8_weight_grads(const std::vector<int64_t>& rows, const T* x, const T* dg, const T* du, const T* d_out,
                        const T* route_weight, const T* hidden, int64_t I, T* d_gate, T* d_up, T* d_down) const {
    const int64_t H = shape_.hidden;
    const auto xq = Fp8Matrix::quantize_columns(rows, x, H);
    fp8_gemm(Fp8Matrix::quantize_columns(rows, dg, I), xq, d_gate, threads_);
    fp8_gemm(Fp8Matrix::quantize_columns(rows, du, I), xq, d_up, threads_);
    fp8_gemm(Fp8Matrix::quantize_columns(rows, d_out, H), Fp8Matrix::quantize_columns(rows, hidden, I, route_weight),
             d_down, threads_);
  }

  template <typename W>
  std::vector<T> shared_forward(CpuContext<T>& ctx, const W& sw) const {
    const int64_t H = shape_.hidden, Is = shape_.shared_intermediate, T_ = ctx.tokens;
    ctx.shared_gate.assign(T_ * Is, T(0));
    ctx.shared_up.assign(T_ * Is, T(0));
    ctx.shared_hidden.assign(T_ * Is, T(0));
    std::vector<T> out(T_ * H);
    parallel_for(T_, threads_, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        gate_up_row(sw, ActivationSpec::of(shape_), ctx.x + t * H, &ctx.shared_gate[t * Is], &ctx.shared_up[t * Is],
                    &ctx.shared_hidden[t * Is]);
        down_row(sw, &ctx.shared_hidden[t * Is], &out[t * H]);
      }
    });
    return out;
  }

  template <typename W>
  std::vector<T> shared_backward(const CpuContext<T>& ctx, const W& sw, const T* d_out, const MoeGradients& g) const {
    const int64_t H = shape_.hidden, Is = shape_.shared_intermediate, T_ = ctx.tokens;
    std::vector<T> dg(T_ * Is), du(T_ * Is), dx(T_ * H);
    parallel_for(T_, threads_, [&](int64_t b, int64_t e) {
      std::vector<T> dh(Is);
      for (int64_t t = b; t < e; ++t)
        backward_row(sw, ActivationSpec::of(shape_), &ctx.shared_gate[t * Is], &ctx.shared_up[t * Is],
                     &ctx.shared_hidden[t * Is], d_out + t * H, T(1), dh.data(), &dg[t * Is], &du[t * Is], &dx[t * H]);
    });
    std::vector<int64_t> tokens(T_);
    for (int64_t t = 0; t < T_; ++t) tokens[t] = t;
    const std::vector<T> ones(T_, T(1));
    if (options_.precision == Precision::fp8) {
      fp8_weight_grads(tokens, ctx.x, dg.data(), du.data(), d_out, ones.data(), ctx.shared_hidden.data(), Is,
                       g.d_ws_gate.as<T>(), g.d_ws_up.as<T>(), g.d_ws_down.as<T>());
      return dx;
    }
    parallel_for(Is + H, threads_, [&](int64_t b, int64_t end) {
      for (int64_t q = b; q < end; ++q) {
        if (q < Is) {
          gate_up_weight_grad_rows(tokens, dg.data(), du.data(), ctx.x, H, Is, q, q + 1, g.d_ws_gate.as<T>(),
                                   g.d_ws_up.as<T>());
        } else {
          down_weight_grad_rows(tokens, ones.data(), d_out, ctx.shared_hidden.data(), H, Is, q - Is, q - Is + 1,
                                g.d_ws_down.as<T>());
        }
      }
    });
    return dx;
  }

  // out[t] = shared[t] + sum_j w[t,j] * combined[t*k+j], j in fixed order.
  void combine_epilogue(const CpuContext<T>& ctx, const T* weights, const T* combined, const std::vector<T>& shared_out,
                        T* out) const {
    const int64_t H = shape_.hidden, k = shape_.top_k;
    parallel_for(ctx.tokens, threads_, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        weighted_sum_row(shared_out.empty() ? nullptr : &shared_out[t * H], weights + t * k, combined + t * k * H, k, H,
                         out + t * H);
    });
  }

  MoeShape shape_;
  ProcessGroup* group_;
  LayerOptions options_;
  int threads_;
};

// Picks the f32 or f64 implementation from each call's x, so one layer object serves both.
class CpuLayerByDtype final : public MoeLayer {
 public:
  CpuLayerByDtype(const MoeShape& shape, ProcessGroup* group, const LayerOptions& options)
      : f32_(shape, group, options), f64_(shape, group, options) {}
  const MoeShape& shape() const override { return f32_.shape(); }
  int rank() const override { return f32_.rank(); }
  int world_size() const override { return f32_.world_size(); }
  const char* backend_name() const override { return "cpu"; }
  std::unique_ptr<MoeContext> forward(const MoeInputs& in, const MoeWeights& w, const TensorView& out,
                                      Stream stream) override {
    return pick(in.x.dtype).forward(in, w, out, stream);
  }
  void backward(const MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                Stream stream) override {
    pick(d_out.dtype).backward(saved, d_out, w, g, stream);
  }

 private:
  MoeLayer& pick(DType dtype) {
    if (dtype == DType::f64) return f64_;
    require(dtype == DType::f32, ErrorCode::invalid_argument,
            std::string("the CPU backend computes in f32 or f64, not ") + to_string(dtype));
    return f32_;
  }
  CpuMoeLayer<float> f32_;
  CpuMoeLayer<double> f64_;
};

}  // namespace

std::unique_ptr<MoeLayer> make_cpu_moe_layer(const MoeShape& shape, ProcessGroup* group, const LayerOptions& options) {
  return std::make_unique<CpuLayerByDtype>(shape, group, options);
}

}  // namespace moka::cpu
