// The megakernel path of MoeLayer: the forward through CudaMegakernelForward (forward_layer.hpp),
// the backward through MegakernelBackward (backward.hpp), and the context that carries what the
// one saved for the other.
#include <mutex>

#include "core/megakernel_plan.hpp"
#include "core/validate.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/common/stream.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/layer_paths.hpp"
#include "cuda/megakernel/backward.hpp"
#include "cuda/megakernel/forward_layer.hpp"
#include "cuda/megakernel/launch.hpp"
#include "moka/device_group.hpp"

namespace moka::cuda {
namespace {

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
    run_backward(saved, d_out, w, g, to_cuda(stream), nullptr);
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
  // The context's grouped g and u take dg and du; g and u by slot go back once unpacked.
  void backward_overwriting(MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                            Stream stream) override {
    auto* ctx = dynamic_cast<MegakernelContext*>(&saved);
    run_backward(saved, d_out, w, g, to_cuda(stream), ctx ? &ctx->saved : nullptr);
  }

 private:
  // `consumed`: the context's saved rows when the caller gave it up (consume_backward).
  void run_backward(const MoeContext& saved, const TensorView& d_out, const MoeWeights& w, const MoeGradients& g,
                    cudaStream_t s, ForwardSaved* consumed) {
    const auto* ctx = dynamic_cast<const MegakernelContext*>(&saved);
    require(ctx != nullptr && ctx->layer == this, ErrorCode::invalid_argument,
            "backward got a context from another layer");
    std::lock_guard<std::mutex> lock(mutex_);
    raise_finished_errors(s);
    clock_.start(StageClock::Direction::backward, s);
    call_order_.before(s);
    backward_megakernel(*ctx, d_out, w, g, s, consumed);
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

  // The megakernel's tiles and its epilogue store gradients 8 and 16 bytes at a time: a caller's
  // gradient at another offset (a view into a larger buffer) is an error here, not a fault there.
  static void require_gradients_aligned(const MoeGradients& g) {
    const std::pair<const TensorView*, const char*> grads[] = {{&g.d_x, "d_x"},
                                                               {&g.d_w_gate, "d_w_gate"},
                                                               {&g.d_w_up, "d_w_up"},
                                                               {&g.d_w_down, "d_w_down"},
                                                               {&g.d_ws_gate, "d_ws_gate"},
                                                               {&g.d_ws_up, "d_ws_up"},
                                                               {&g.d_ws_down, "d_ws_down"}};
    for (const auto& [view, name] : grads) {
      const auto offset = reinterpret_cast<uintptr_t>(view->data) % 16;
      require(offset == 0, ErrorCode::invalid_argument,
              std::string("the megakernel path needs 16-byte aligned gradients: ") + name + " starts " +
                  std::to_string(offset) + " bytes past a 16-byte boundary");
    }
  }

  // A context's g and u by slot as the backward megakernel reads them: grouped rows, unpacked
  // into memory of the call's, which the backward then writes dg and du over (empty for a
  // context of grouped rows, and in replay, where the backward recomputes them). A consumed
  // context's rows go back as soon as they are unpacked, one at a time.
  struct GroupedGateUp {
    DeviceArray<bf16> gate, up;
  };
  GroupedGateUp unpack_gate_up(const ForwardSaved& saved, ForwardSaved* consumed, cudaStream_t s) const {
    GroupedGateUp rows;
    if (!saved.by_slot) return rows;
    const size_t elements = size_t(saved.ring_rows * shape_.intermediate);
    for (auto [grouped, by_slot] : {std::pair{&rows.gate, &saved.gate}, std::pair{&rows.up, &saved.up}}) {
      *grouped = DeviceArray<bf16>(elements, kernel_.allocator(), s);
      unpack_saved_rows(saved_rows(saved, shape_.intermediate, grouped->data(), by_slot->data()), s);
      if (consumed) (by_slot == &saved.gate ? consumed->gate : consumed->up).release();  // `saved` itself
    }
    return rows;
  }

  // The pulls read every row's d_out, route weight and x from its origin rank; the pushes write
  // its d_x slots and d_topk_weights. EP = 1: the call's own tensors and d_x slots of its own,
  // through one-entry tables; EP > 1: d_out and the route weights copied into symmetric buffers
  // first (x too when a later forward replaced it), the d_x slots are the forward's combine
  // buffers (free between calls), d_topk_weights copied out after.
  void backward_megakernel(const MegakernelContext& ctx, const TensorView& d_out, const MoeWeights& w,
                           const MoeGradients& g, cudaStream_t s, ForwardSaved* consumed) {
    const MoeShape& sh = shape_;
    const int64_t T = ctx.tokens;
    const Device dev = Device::cuda(kernel_.device());
    core::validate_layer_tensors(sh, world_, ctx.inputs, w, DType::bf16, dev);
    core::validate_layer_gradients(sh, world_, T, g, DType::bf16, dev);
    expect_tensor(d_out, "d_out", DType::bf16, dev, {T, sh.hidden});
    require_gradients_aligned(g);
    ctx.saved.used_on(s);
    const GroupedGateUp gate_up = unpack_gate_up(ctx.saved, consumed, s);
    clock_.mark("unpack", s);
    MegakernelBackwardIo io;
    DeviceArray<bf16> dx_slots;  // EP = 1: the dx tiles store into them (no d_x rows in the ring)
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
      dx_slots = DeviceArray<bf16>(size_t(T * (sh.top_k - 1) * sh.hidden), kernel_.allocator(), s);
      tables.at[2] = dx_slots.data();
      io.dx_into_slots = true;
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
    const bool unpacked = ctx.saved.by_slot;
    io.context_gate = unpacked ? gate_up.gate.data() : ctx.saved.gate.data();
    io.context_up = unpacked ? gate_up.up.data() : ctx.saved.up.data();
    io.overwrite_context = unpacked || consumed != nullptr;  // grouped rows of the call's or given up
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
