// The bf16 MoE layer on one GPU. Stages mirror the CPU reference (src/cpu/cpu_layer.cpp):
//   device schedule -> gather x -> grouped gate|up GEMM (the shared expert's products are two
//   more groups) -> SwiGLU pass -> grouped down GEMM -> combine (shared + sum_j w_j y_j, fp32,
//   fixed j order). LayerOptions::fused_swiglu instead runs an up launch, then a gate launch with
//   SwiGLU in its epilogue (reads U, writes G and H): the same bits, slower on the H200.
// Backward: gather d_out -> grouped dY W_down -> SwiGLU backward (+ d_w = <dh_u, h>) ->
//   weight gradients dY^T (w h), then gather x -> dG^T X, dU^T X per expert -> grouped dG W_gate,
//   dU W_up -> fixed-order token sum.
// Backward reads the weights and the routed activations where they are: dY W takes W as an
// MN-major B, and dY^T X both activations as MN-major operands with K = the expert's rows.
// The host never reads a routed count: every size reaches the GEMMs through device memory.
// With experts split over a DeviceGroup (the expert-parallel all-to-all path), ExpertExchange
// replaces the device schedule and the gathers at the edges: rows arrive from every rank over
// NCCL and go back before the combine; split sizes pass through the host there.
// Memory: a forward's context keeps the routes, the row order and the routed rows' gate and up
// products (SaveMode::none: the routes and row order only, gate|up recomputed in backward);
// hidden is recomputed in the activation's backward, x's rows gathered again. One rank's expert
// segments are not padded (the grouped GEMMs bound every tile by its expert's row count, and any
// row of a 16-byte-wide buffer starts 16-byte aligned): the grouped buffers hold T*k rows, as
// many as the routes. Every other buffer is the call's, from LayerOptions::allocator (moka's stream-ordered pool by default), and goes
// back as soon as its last reader is enqueued.
#include <algorithm>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <sstream>

#include "core/schedule.hpp"
#include "core/validate.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/common/stage_clock.hpp"
#include "cuda/common/stream.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/layer/expert_exchange.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_gemms.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/layer_paths.hpp"

namespace moka::cuda {
namespace {

using namespace staged;  // the buffer table's indices and the layer's GEMMs (layer_gemms.hpp)

// Buffer-table entries of one call, from the layer's allocator on the call's stream; each goes
// back (stream-ordered) at release() or when the call ends.
struct CallBuffers {
  DeviceAllocator* allocator;
  cudaStream_t stream;
  DeviceArray<bf16> bufs[kNumBufs];
  bf16* take(Buf b, int64_t elems) {
    bufs[b] = DeviceArray<bf16>(size_t(elems), *allocator, stream);
    return bufs[b].data();
  }
  void release(std::initializer_list<Buf> which) {
    for (Buf b : which) bufs[b].release();
  }
};

// The one context type of the CUDA layer, whichever path ran the forward. It owns what its
// backward reads: the routes and row order, the gate and up products of the routed rows and of
// the shared expert (SaveMode::gate_up), and across ranks the grouped x and route weights; every
// other buffer of a call lives only inside that call.
struct CudaContext final : MoeContext {
  const class CudaMoeLayer* layer = nullptr;  // the staged layer that runs the backward
  uint64_t generation = 0;
  int64_t tokens = 0, rows = 0;   // rows: the grouped buffers' (one rank: the worst case)
  cudaStream_t stream = nullptr;  // the forward's
  MoeInputs inputs;               // the forward's views (the caller keeps them alive, as autograd does)
  DeviceArray<int32_t> counts, offsets, row_of_slot;
  DeviceArray<bf16> saved[kNumBufs];
  DeviceArray<float> row_weight;  // across ranks: each grouped row's route weight
  std::vector<int64_t> local_expert_rows() const override;
  int64_t saved_bytes() const override {
    int64_t bytes = int64_t(counts.bytes() + offsets.bytes() + row_of_slot.bytes() + row_weight.bytes());
    for (const auto& b : saved) bytes += int64_t(b.bytes());
    return bytes;
  }
  // The backward on `stream` reads it last: the memory goes back there.
  void used_on(cudaStream_t stream) const {
    for (const auto* a : {&counts, &offsets, &row_of_slot}) a->release_on(stream);
    for (const auto& b : saved) b.release_on(stream);
    row_weight.release_on(stream);
  }
};

// The routed rows the row-wise kernels visit: entry i is grouped row rows[i] (or none if < 0).
struct RowMap {
  const int32_t* rows;
  int64_t entries;
};

class CudaMoeLayer final : public MoeLayer {
 public:
  // `group` null: one rank. Otherwise the experts are split over it (it must outlive the layer,
  // or be `owned`).
  CudaMoeLayer(const MoeShape& shape, DeviceGroup* group, std::unique_ptr<DeviceGroup> owned,
               const LayerOptions& options, GemmEngine engine)
      : shape_(shape), options_(options), engine_(engine), act_(ActParams::of(shape)),
        fused_swiglu_(options.fused_swiglu && engine == GemmEngine::cutlass), world_(group ? group->size() : 1),
        rank_(group ? group->rank() : 0), local_experts_(shape.num_experts / world_), owned_group_(std::move(owned)) {
    core::validate_shape(shape_, world_);
    require(options_.tile_rows >= 1 && options_.tile_rows <= (1 << 16), ErrorCode::invalid_argument,
            "tile_rows must be in [1, 65536]");
    require(shape_.hidden % 8 == 0 && shape_.intermediate % 8 == 0 && shape_.shared_intermediate % 8 == 0,
            ErrorCode::unsupported_size,
            "the CUDA backend needs hidden, intermediate and shared sizes that are multiples of 8 (16-byte rows)");
    require(options_.tile_rows % 8 == 0, ErrorCode::unsupported_size,
            "the CUDA backend needs tile_rows to be a multiple of 8 (16-byte aligned expert segments), got " +
                std::to_string(options_.tile_rows));
    require(shape_.num_experts <= 8192, ErrorCode::unsupported_size, "the CUDA backend takes at most 8192 experts");
    MOKA_CUDA_CHECK(cudaGetDevice(&device_));
    if (world_ > 1) {
      require(engine_ == GemmEngine::cutlass, ErrorCode::invalid_argument, "the cuBLAS-loop baseline is single-rank");
      control_ = host_collectives(*group);
      exchange_ = std::make_unique<ExpertExchange>(*group, shape_, options_.tile_rows);
    }
  }
  CudaMoeLayer(const CudaMoeLayer&) = delete;
  CudaMoeLayer& operator=(const CudaMoeLayer&) = delete;
  const MoeShape& shape() const override { return shape_; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend_name() const override { return engine_ == GemmEngine::cutlass ? "cuda" : "cuda-cublas-loop"; }

  std::unique_ptr<MoeContext> forward(const MoeInputs& in, const MoeWeights& w, const TensorView& out,
                                      Stream stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    report_device_errors();
    const Device dev = Device::cuda(device_);
    const int64_t T = in.x.rank == 2 ? in.x.dim(0) : 0, H = shape_.hidden;
    const cudaStream_t s = to_cuda(stream);
    clock_.start(StageClock::Direction::forward, s);
    auto check_tensors = [&] {
      core::validate_layer_tensors(shape_, world_, in, w, DType::bf16, dev);
      require(T >= 1, ErrorCode::invalid_argument, "the CUDA layer needs at least one token");
      expect_tensor(out, "out", DType::bf16, dev, {T, H});
    };
    if (exchange_) {
      plan_exchange(in, T, check_tensors, s);
    } else {
      check_tensors();
    }
    call_order_.before(s);
    auto ctx = std::make_unique<CudaContext>();
    ctx->layer = this;
    ctx->generation = ++generation_;
    ctx->tokens = T;
    ctx->stream = s;
    ctx->inputs = in;
    run_forward(*ctx, w, out, s);
    call_order_.after(s);
    return ctx;
  }

  void check_errors() override {
    std::lock_guard<std::mutex> lock(mutex_);
    report_device_errors();
  }
  void record_stage_times(bool on) override { clock_.set_on(on); }
  std::vector<StageTime> stage_times() const override { return clock_.read(); }

  void backward(const MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                Stream stream) override {
    backward(saved, d_out, w, g, stream, nullptr);
  }

 protected:
  void backward_overwriting(MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                            Stream stream) override {
    backward(saved, d_out, w, g, stream, dynamic_cast<CudaContext*>(&saved));
  }

 private:
  // `consumed`: the context itself when the backward may write its scratch over what it saved
  // and free it early; else null.
  void backward(const MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                Stream stream, CudaContext* consumed) {
    const auto* ctx = dynamic_cast<const CudaContext*>(&saved);
    require(ctx != nullptr && ctx->layer == this, ErrorCode::invalid_argument,
            "backward got a context from another layer");
    std::lock_guard<std::mutex> lock(mutex_);
    // Across ranks the exchange's plan (send positions, received rows) is the latest forward's.
    require(!exchange_ || ctx->generation == generation_, ErrorCode::invalid_argument,
            "backward got the context of an older forward: across ranks the CUDA layer's exchange keeps the "
            "plan of its latest forward only");
    report_device_errors();
    const Device dev = Device::cuda(device_);
    const int64_t T = ctx->tokens;
    core::validate_collectively(control_.get(), signature(T), [&] {
      expect_tensor(d_out, "d_out", DType::bf16, dev, {T, shape_.hidden});
      core::validate_layer_gradients(shape_, world_, T, g, DType::bf16, dev);
      core::validate_layer_tensors(shape_, world_, ctx->inputs, w, DType::bf16, dev);
    });
    const cudaStream_t s = to_cuda(stream);
    clock_.start(StageClock::Direction::backward, s);
    call_order_.before(s);
    ctx->used_on(s);
    run_backward(*ctx, d_out, w, g, s, consumed);
    call_order_.after(s);
  }

  DeviceAllocator& allocator() const { return options_.allocator ? *options_.allocator : default_device_allocator(); }
  CallBuffers call_buffers(cudaStream_t s) const { return CallBuffers{&allocator(), s, {}}; }

  // The forward's stages into `ctx` (routes, row order and what it saves) and `out`; the call's
  // other buffers go back as soon as their last reader is enqueued.
  void run_forward(CudaContext& ctx, const MoeWeights& w, const TensorView& out, cudaStream_t s) {
    const int64_t T = ctx.tokens, H = shape_.hidden, I = shape_.intermediate, k = shape_.top_k;
    const int64_t Is = shape_.shared_intermediate, E = local_experts_;
    const bool shared = shape_.has_shared();
    ctx.rows = exchange_ ? exchange_->grouped_rows() : T * k;
    require(ctx.rows < (int64_t(1) << 31), ErrorCode::unsupported_size, "too many routed rows for int32 offsets");
    const int64_t R = std::max<int64_t>(ctx.rows, 1);
    LayerGemms& gemms = gemms_for(T);
    DeviceAllocator& from = allocator();
    ctx.counts = DeviceArray<int32_t>(size_t(E), from, s);
    ctx.offsets = DeviceArray<int32_t>(size_t(E + 1), from, s);
    ctx.row_of_slot = DeviceArray<int32_t>(size_t(T * k), from, s);
    CallBuffers call = call_buffers(s);
    if (exchange_) {
      ctx.row_weight = DeviceArray<float>(size_t(R), from, s);
      exchange_->dispatch_scalars(ctx.inputs.topk_weights.as<float>(), ctx.row_weight.data(), s);
      exchange_->upload_schedule(ctx.counts.data(), ctx.offsets.data());
    } else {
      DeviceArray<int32_t> chunk_counts(size_t(schedule_chunks(T * k) * E), from, s);
      build_schedule(schedule(ctx, chunk_counts.data()), ctx.inputs.topk_ids.as<int32_t>(),
                     ctx.inputs.topk_weights.as<float>(), s);
    }
    clock_.mark("schedule", s);
    // What the backward reads is the context's (gate and up, and across ranks the grouped x,
    // which only another all-to-all could bring back); the rest is the call's.
    const bool keep = options_.save == SaveMode::gate_up;
    auto take = [&](Buf b, int64_t elems, bool saved) {
      if (!saved) return call.take(b, elems);
      ctx.saved[b] = DeviceArray<bf16>(size_t(elems), from, s);
      return ctx.saved[b].data();
    };
    bf16* grouped_x = take(kGroupedInput, R * H, exchange_ != nullptr);
    take(kGateOut, R * I, keep);
    take(kUpOut, R * I, keep);
    call.take(kHidden, R * I);
    if (shared) {
      take(kSharedGateOut, T * Is, keep);
      take(kSharedUpOut, T * Is, keep);
      call.take(kSharedHidden, T * Is);
      call.take(kSharedOut, T * H);
    }
    dispatch(ctx.inputs.x.as<bf16>(), grouped_x, ctx, s);
    clock_.mark(exchange_ ? "dispatch" : "gather", s);
    BufferTable table = buffer_table(ctx, call, ctx.inputs.x, w);
    run_gate_up(gemms, table, ctx, s);
    clock_.mark(fused_swiglu_ ? "gate_up+swiglu" : "gate_up", s);
    if (!fused_swiglu_) {
      swiglu_forward_rows(ptr(table, kGateOut), ptr(table, kUpOut), ptr(table, kHidden), routed_rows(ctx).rows,
                          routed_rows(ctx).entries, I, act_, s);
      if (shared)
        swiglu_forward_rows(ptr(table, kSharedGateOut), ptr(table, kSharedUpOut), ptr(table, kSharedHidden), nullptr, T,
                            Is, act_, s);
      clock_.mark("swiglu", s);
    }
    call.release({kGroupedInput});
    table.ptr[kExpertOut] = call.take(kExpertOut, R * H);
    gemms.down->run(table, ctx.counts.data(), ctx.offsets.data(), s);
    clock_.mark("down", s);
    call.release({kHidden, kSharedHidden, kGateOut, kUpOut, kSharedGateOut, kSharedUpOut});
    const bf16* y = ptr(table, kExpertOut);
    DeviceArray<bf16> returned_y;
    if (exchange_) {
      returned_y = DeviceArray<bf16>(size_t(T * k * H), from, s);
      exchange_->combine(y, returned_y.data(), H, s);
      y = returned_y.data();
    }
    combine_tokens(y, ctx.inputs.topk_weights.as<float>(), shared ? ptr(table, kSharedOut) : nullptr, out.as<bf16>(),
                   slot_map(ctx), T, k, H, s);
    clock_.mark("combine", s);
  }

  // gate|up of the grouped rows (and the shared expert's of x) into the table's buffers.
  void run_gate_up(LayerGemms& gemms, const BufferTable& table, const CudaContext& ctx, cudaStream_t s) const {
    if (fused_swiglu_) {
      gemms.up->run(table, ctx.counts.data(), ctx.offsets.data(), s);
      gemms.gate->run(table, ctx.counts.data(), ctx.offsets.data(), s);  // G and H, from U
    } else {
      gemms.gate_up->run(table, ctx.counts.data(), ctx.offsets.data(), s);
    }
  }

  // The backward's stages, in an order that keeps few buffers alive at once: the weight
  // gradients (which need the grouped x and d_out) before the input gradient's two halves. The
  // SwiGLU backward writes dG over dh, and over gate and up (when they are this call's, or the
  // context is `consumed`) w·h and dU; a consumed context's w·h goes back after the weight
  // gradients, before the input gradient's halves are taken.
  void run_backward(const CudaContext& ctx, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                    cudaStream_t s, CudaContext* consumed) {
    const int64_t T = ctx.tokens, H = shape_.hidden, I = shape_.intermediate, k = shape_.top_k;
    const int64_t Is = shape_.shared_intermediate, E = local_experts_, R = std::max<int64_t>(ctx.rows, 1);
    const bool shared = shape_.has_shared();
    LayerGemms& gemms = gemms_for(T);
    CallBuffers call = call_buffers(s);
    const int32_t* counts = ctx.counts.data();
    const int32_t* offsets = ctx.offsets.data();
    // One rank gathers x's rows again (a copy, cheaper to redo than to keep): first thing when
    // gate|up is recomputed from them, else for the gate and up weight gradients.
    const bool recompute = options_.save == SaveMode::none;
    auto gather_x = [&] {
      bf16* rows = call.take(kGroupedInput, R * H);
      dispatch(ctx.inputs.x.as<bf16>(), rows, ctx, s);
      clock_.mark("gather_x", s);
      return rows;
    };
    if (!exchange_ && recompute) gather_x();
    if (recompute) {  // gate|up again, on the same rows: the same bits
      call.take(kGateOut, R * I);
      call.take(kUpOut, R * I);
      if (fused_swiglu_) call.take(kHidden, R * I);
      if (shared) {
        call.take(kSharedGateOut, T * Is);
        call.take(kSharedUpOut, T * Is);
        if (fused_swiglu_) call.take(kSharedHidden, T * Is);
      }
      run_gate_up(gemms, buffer_table(ctx, call, ctx.inputs.x, w), ctx, s);
      call.release({kHidden, kSharedHidden});
      clock_.mark("recompute_gate_up", s);
    }
    dispatch(d_out.as<bf16>(), call.take(kGroupedOutGrad, R * H), ctx, s);
    clock_.mark(exchange_ ? "dispatch_d_out" : "gather_d_out", s);
    call.take(kHiddenGradUnweighted, R * I);
    if (shared) call.take(kSharedHiddenGrad, T * Is);
    BufferTable table = with_gradients(buffer_table(ctx, call, ctx.inputs.x, w), d_out, g);
    gemms.data_grad_h->run(table, counts, offsets, s);
    clock_.mark("dh", s);
    // Route weights and d_w per visited entry: per slot on one rank, per received route across ranks.
    DeviceArray<float> row_d_weight;
    if (exchange_) row_d_weight = DeviceArray<float>(size_t(R), allocator(), s);
    const float* route_w = exchange_ ? ctx.row_weight.data() : ctx.inputs.topk_weights.as<float>();
    float* route_dw = exchange_ ? row_d_weight.data() : g.d_topk_weights.as<float>();
    // In place: each element is read by the thread that then writes it.
    const bool in_place = consumed != nullptr || options_.save == SaveMode::none;
    auto written_over = [&](Buf result, Buf input, int64_t elems) {
      table.ptr[result] = in_place ? table.ptr[input] : call.take(result, elems);
    };
    written_over(kWeightedHidden, kGateOut, R * I);
    written_over(kUpGrad, kUpOut, R * I);
    table.ptr[kGateGrad] = table.ptr[kHiddenGradUnweighted];
    const RowMap map = routed_rows(ctx);
    swiglu_backward_rows(ptr(table, kGateOut), ptr(table, kUpOut), ptr(table, kHiddenGradUnweighted), route_w, route_dw,
                         ptr(table, kWeightedHidden), ptr(table, kGateGrad), ptr(table, kUpGrad), map.rows, map.entries,
                         I, act_, s);
    if (shared) {
      written_over(kSharedHidden, kSharedGateOut, T * Is);
      written_over(kSharedUpGrad, kSharedUpOut, T * Is);
      table.ptr[kSharedGateGrad] = table.ptr[kSharedHiddenGrad];
      swiglu_backward_rows(ptr(table, kSharedGateOut), ptr(table, kSharedUpOut), ptr(table, kSharedHiddenGrad), nullptr,
                           nullptr, ptr(table, kSharedHidden), ptr(table, kSharedGateGrad), ptr(table, kSharedUpGrad),
                           nullptr, T, Is, act_, s);
    }
    if (!in_place) call.release({kGateOut, kUpOut, kSharedGateOut, kSharedUpOut});
    clock_.mark("swiglu_backward", s);
    zero_empty_experts(counts, E, g.d_w_gate.as<bf16>(), g.d_w_up.as<bf16>(), g.d_w_down.as<bf16>(), I * H, s);
    gemms.weight_grad_down->run(table, counts, offsets, s);
    clock_.mark("weight_grads_down", s);
    call.release({kGroupedOutGrad, kWeightedHidden, kSharedHidden, kGateOut, kSharedGateOut});
    if (consumed)
      for (Buf b : {kGateOut, kSharedGateOut}) consumed->saved[b].release();
    if (!exchange_ && !recompute) table.ptr[kGroupedInput] = gather_x();
    gemms.weight_grad_gate_up->run(table, counts, offsets, s);
    clock_.mark("weight_grads_gate_up", s);
    call.release({kGroupedInput});
    for (Buf b : {kInputGradViaGate, kInputGradViaUp}) table.ptr[b] = call.take(b, R * H);
    if (shared)
      for (Buf b : {kSharedInputGradViaGate, kSharedInputGradViaUp}) table.ptr[b] = call.take(b, T * H);
    gemms.data_grad_x->run(table, counts, offsets, s);
    clock_.mark("dx", s);
    const bf16 *dxa = ptr(table, kInputGradViaGate), *dxb = ptr(table, kInputGradViaUp);
    DeviceArray<bf16> returned_dxa, returned_dxb;
    if (exchange_) {
      returned_dxa = DeviceArray<bf16>(size_t(T * k * H), allocator(), s);
      returned_dxb = DeviceArray<bf16>(size_t(T * k * H), allocator(), s);
      exchange_->combine(dxa, returned_dxa.data(), H, s);
      exchange_->combine(dxb, returned_dxb.data(), H, s);
      exchange_->combine_scalars(route_dw, g.d_topk_weights.as<float>(), s);
      dxa = returned_dxa.data();
      dxb = returned_dxb.data();
    }
    reduce_input_grads(dxa, dxb, shared ? ptr(table, kSharedInputGradViaGate) : nullptr,
                       shared ? ptr(table, kSharedInputGradViaUp) : nullptr, g.d_x.as<bf16>(), slot_map(ctx), T, k, H,
                       s);
    clock_.mark(exchange_ ? "combine+reduce" : "reduce", s);
  }

  static bf16* ptr(const BufferTable& t, Buf b) { return static_cast<bf16*>(const_cast<void*>(t.ptr[b])); }

  core::LayerSignature signature(int64_t tokens) const { return core::layer_signature(shape_, tokens, DType::bf16); }

  // Across ranks: the tensors are checked on every rank at once; then the exchange plans the
  // call (its one synchronization), after which the device's routing check is known, and any
  // rank's bad routing is raised on every rank.
  void plan_exchange(const MoeInputs& in, int64_t T, const std::function<void()>& check_tensors, cudaStream_t s) {
    core::validate_collectively(control_.get(), signature(T), check_tensors);
    exchange_->plan(in.topk_ids.as<int32_t>(), in.topk_weights.as<float>(), T, s);
    core::validate_collectively(control_.get(), signature(T), [&] {
      const unsigned long long e = exchange_->routing_error();
      if (e != kNoRoutingError) throw routing_error(e, shape_.top_k, shape_.num_experts, "");
    });
  }

  // Rows of x or d_out into the grouped buffer: a local gather, or the all-to-all dispatch.
  void dispatch(const bf16* tokens, bf16* grouped, const CudaContext& ctx, cudaStream_t s) const {
    if (exchange_) {
      exchange_->dispatch(tokens, grouped, shape_.hidden, s);
    } else {
      gather_rows(tokens, grouped, ctx.row_of_slot.data(), ctx.tokens * shape_.top_k, shape_.top_k, shape_.hidden, s);
    }
  }

  // One rank: the slots (non-local ones map to -1). Across ranks: every grouped row, padding
  // included (padding rows compute on garbage no product reads: the GEMMs take real rows only).
  RowMap routed_rows(const CudaContext& ctx) const {
    if (exchange_) return {nullptr, ctx.rows};
    return {ctx.row_of_slot.data(), ctx.tokens * shape_.top_k};
  }
  // Where slot token*k+j's routed row is read by the combine and the d_x reduction.
  const int32_t* slot_map(const CudaContext& ctx) const {
    return exchange_ ? exchange_->send_position_of_slot() : ctx.row_of_slot.data();
  }

  // A routing error found by the device check of an earlier call (the host reads mapped
  // memory; it never waits for the device here). Reported once, then cleared.
  void report_device_errors() {
    const unsigned long long e = error_.load();
    if (e == kNoRoutingError) return;
    error_.store(kNoRoutingError);
    throw routing_error(e, shape_.top_k, shape_.num_experts,
                        "an earlier call's routing was invalid (that call's outputs are invalid) at ");
  }

  DeviceSchedule schedule(const CudaContext& ctx, int32_t* chunk_counts) const {
    DeviceSchedule d;
    d.slots = ctx.tokens * shape_.top_k;
    d.num_experts = local_experts_;
    d.first_expert = 0;
    d.global_experts = shape_.num_experts;
    d.tile_rows = 1;  // segments back to back (the exchange path's blocks follow tile_rows)
    d.top_k = shape_.top_k;
    d.chunk_counts = chunk_counts;
    d.counts = ctx.counts.data();
    d.offsets = ctx.offsets.data();
    d.row_of_slot = ctx.row_of_slot.data();
    d.error = error_.device();
    return d;
  }

  // The context's and the call's buffers plus the caller's x and weights.
  static BufferTable buffer_table(const CudaContext& ctx, const CallBuffers& call, const TensorView& x,
                                  const MoeWeights& w) {
    BufferTable t;
    for (int b = 0; b < kNumBufs; ++b) t.ptr[b] = ctx.saved[b].empty() ? call.bufs[b].data() : ctx.saved[b].data();
    t.ptr[kInput] = x.data;
    t.ptr[kGateWeight] = w.w_gate.data;
    t.ptr[kUpWeight] = w.w_up.data;
    t.ptr[kDownWeight] = w.w_down.data;
    t.ptr[kSharedGateWeight] = w.ws_gate.data;
    t.ptr[kSharedUpWeight] = w.ws_up.data;
    t.ptr[kSharedDownWeight] = w.ws_down.data;
    return t;
  }
  static BufferTable with_gradients(BufferTable t, const TensorView& d_out, const MoeGradients& g) {
    t.ptr[kOutGrad] = d_out.data;
    t.ptr[kGateWeightGrad] = g.d_w_gate.data;
    t.ptr[kUpWeightGrad] = g.d_w_up.data;
    t.ptr[kDownWeightGrad] = g.d_w_down.data;
    t.ptr[kSharedGateWeightGrad] = g.d_ws_gate.data;
    t.ptr[kSharedUpWeightGrad] = g.d_ws_up.data;
    t.ptr[kSharedDownWeightGrad] = g.d_ws_down.data;
    return t;
  }

  // The GEMMs for T tokens: the latest token count's are kept (building them allocates and
  // initializes CUTLASS arguments).
  LayerGemms& gemms_for(int64_t T) {
    if (!gemms_ || gemms_->tokens != T) {
      gemms_.reset();  // its device scratch is freed by cudaFree, which waits for the device
      gemms_ = build_layer_gemms(shape_, local_experts_, T, fused_swiglu_ ? &act_ : nullptr, device_, engine_);
    }
    return *gemms_;
  }

  MoeShape shape_;
  LayerOptions options_;
  GemmEngine engine_;
  ActParams act_;
  bool fused_swiglu_;  // SwiGLU in the gate GEMM's epilogue (the CUTLASS engine only)
  int world_, rank_;
  int64_t local_experts_;
  std::unique_ptr<DeviceGroup> owned_group_;
  std::unique_ptr<ProcessGroup> control_;     // host collectives over the device group (ranks > 1)
  std::unique_ptr<ExpertExchange> exchange_;  // null on one rank
  int device_ = 0;
  PinnedWord<unsigned long long> error_{kNoRoutingError};  // the device routing check's first bad slot
  uint64_t generation_ = 0;
  std::unique_ptr<LayerGemms> gemms_;
  // Host state (the GEMMs, the generation, the error word, the last call's stream) is shared by
  // the callers' threads: one call at a time.
  std::mutex mutex_;
  // Calls on different streams (or threads) share the GEMMs' device scratch: each call's work
  // waits for the previous call's.
  CallOrder call_order_;
  StageClock clock_;  // record_stage_times
};

// Reads the routed row counts after `stream` (a synchronization: for tests and statistics only).
std::vector<int64_t> CudaContext::local_expert_rows() const {
  std::vector<int32_t> c(layer->num_local_experts());
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOKA_CUDA_CHECK(cudaMemcpy(c.data(), counts.data(), c.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return {c.begin(), c.end()};
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: the backend is unavailable, not an error
    return 0;
  }
  return n;
}

std::unique_ptr<MoeLayer> make_staged_layer(const MoeShape& shape, DeviceGroup* group,
                                            std::unique_ptr<DeviceGroup> owned, const LayerOptions& options,
                                            GemmEngine engine) {
  return std::make_unique<CudaMoeLayer>(shape, group, std::move(owned), options, engine);
}

std::unique_ptr<MoeLayer> make_cuda_baseline_layer(const MoeShape& shape, const LayerOptions& options) {
  return make_staged_layer(shape, nullptr, nullptr, options, GemmEngine::cublas_loop);
}

}  // namespace moka::cuda
