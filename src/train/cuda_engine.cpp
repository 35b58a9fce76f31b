#include "train/cuda_engine.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "train/cuda_kernels.cuh"

namespace moka::train {
namespace {

using cuda::bf16;

using ::moka::cuda::DeviceArray;
using ::moka::cuda::PinnedArray;

// The FFN and router tensors are read by moka's bf16 layers: they keep a bf16 copy of the
// master weights and receive bf16 gradients.
bool read_by_moka_layer(TensorClass c) {
  switch (c) {
    case TensorClass::router:
    case TensorClass::expert_fc1:
    case TensorClass::expert_fc2:
    case TensorClass::shared_fc1:
    case TensorClass::shared_fc2:
    case TensorClass::dense_fc1:
    case TensorClass::dense_fc2: return true;
    default: return false;
  }
}

struct DeviceParam {
  TensorRule rule;
  int64_t n = 0;
  DeviceArray<float> value, m, v, ema, grad;  // grad: tensors of the dense path
  // shadow: the bf16 copy the moka layers (and, with bf16 matmuls, the projections) read;
  // grad16: the bf16 gradient of the moka layers' tensors.
  DeviceArray<bf16> shadow, grad16;
  bool bf16_grad() const { return !grad16.empty(); }
  const void* grad_data() const { return bf16_grad() ? static_cast<const void*>(grad16.data()) : grad.data(); }
  float fwd() const { return float(rule.forward_multiplier); }
};

float bf16_to_float(bf16 b) {
  uint16_t bits;
  std::memcpy(&bits, &b, 2);
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}


// Every launch the captured step holds: kernels, memsets and memcpys (the event records that
// mark stages and the graph's memory nodes are not launches).
int64_t launches_in(cudaGraph_t graph) {
  size_t n = 0;
  MOKA_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  MOKA_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  int64_t launches = 0;
  for (auto node : nodes) {
    cudaGraphNodeType type;
    MOKA_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    launches += type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset || type == cudaGraphNodeTypeMemcpy;
  }
  return launches;
}

// The GPU engine's stage clock: each mark records an event on the engine's stream (inside a
// capture, an event-record node of the graph, so every replay records it). After the step has
// finished, the time between consecutive marks is the earlier mark's stage's. While counting, a
// mark also notes how many launches the capture holds so far.
class DeviceStageClock final : public StageMarker {
 public:
  struct Mark {
    int stage;  // -1: the step's end
    cudaEvent_t event;
    int64_t launches_before;
  };
  DeviceStageClock(cudaStream_t stream, StepProfile& profile) : stream_(stream), profile_(profile) {}
  ~DeviceStageClock() {
    for (auto* pool : {&eager_, &captured_})
      for (auto e : *pool) cudaEventDestroy(e);
  }
  DeviceStageClock(const DeviceStageClock&) = delete;
  DeviceStageClock& operator=(const DeviceStageClock&) = delete;

  void new_step() {
    marks_.clear();
    next_eager_ = 0;
  }
  // While the stream is capturing, marks become event-record nodes of the graph.
  void set_capture(bool capture) { capture_ = capture; }
  void mark(Stage s) override { record(int(s)); }
  // The marks so far, handed over; end() first marks the end of the step.
  std::vector<Mark> take() { return std::exchange(marks_, {}); }
  std::vector<Mark> end() {
    record(-1);
    return take();
  }

  // After the marks' work has finished: adds each stage's time (and, from a capture's marks,
  // its launches) to the profile.
  void accumulate(const std::vector<Mark>& marks) {
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      float ms = 0;
      MOKA_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i].event, marks[i + 1].event));
      profile_.add_stage(Stage(marks[i].stage), ms);
    }
    float total = 0;
    MOKA_CUDA_CHECK(cudaEventElapsedTime(&total, marks.front().event, marks.back().event));
    profile_.step_ms += total;
    ++profile_.steps;
  }
  void count_launches(const std::vector<Mark>& marks, int64_t launches_per_step) {
    profile_.launches = {};
    for (size_t i = 0; i + 1 < marks.size(); ++i)
      profile_.launches[size_t(marks[i].stage)] += marks[i + 1].launches_before - marks[i].launches_before;
    profile_.launches_per_step = launches_per_step;
  }

 private:
  void record(int stage) {
    int64_t launches = 0;
    cudaEvent_t e;
    if (capture_) {
      // The graph's node records this event at every replay: it is never recorded eagerly.
      e = create(captured_);
      MOKA_CUDA_CHECK(cudaEventRecordWithFlags(e, stream_, cudaEventRecordExternal));
      cudaStreamCaptureStatus status;
      cudaGraph_t graph = nullptr;
      MOKA_CUDA_CHECK(cudaStreamGetCaptureInfo(stream_, &status, nullptr, &graph));
      launches = launches_in(graph);
    } else {
      e = next_eager_ < eager_.size() ? eager_[next_eager_] : create(eager_);
      ++next_eager_;
      MOKA_CUDA_CHECK(cudaEventRecord(e, stream_));
    }
    marks_.push_back({stage, e, launches});
  }
  static cudaEvent_t create(std::vector<cudaEvent_t>& pool) {
    cudaEvent_t e;
    MOKA_CUDA_CHECK(cudaEventCreate(&e));
    pool.push_back(e);
    return e;
  }

  cudaStream_t stream_;
  StepProfile& profile_;
  std::vector<cudaEvent_t> eager_, captured_;  // eager marks reuse theirs step after step
  size_t next_eager_ = 0;
  bool capture_ = false;
  std::vector<Mark> marks_;
};

}  // namespace

struct CudaEngine::Impl {
  struct Layer {
    bool is_moe = false;
    int moe_index = -1;
    int64_t experts = 1, top_k = 1, intermediate = 0;
    DeviceParam *attn_norm = nullptr, *ffn_norm = nullptr, *attn_out = nullptr, *router = nullptr;
    DeviceParam *gate = nullptr, *up = nullptr, *down = nullptr;
    DeviceParam *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
    std::vector<DeviceParam*> attn;  // MLA: q_down, q_up, kv_down, k_up, v_up; MHA: q, k, v
    std::unique_ptr<MoeLayer> ffn;
    std::unique_ptr<Router> router_op;
    std::unique_ptr<MoeContext> ffn_ctx;
    std::unique_ptr<RouterContext> router_ctx;
    // Saved by forward for backward.
    // probs [B*H, S, S] for the reference attention, lse [B*H, S] for the fused one.
    DeviceArray<float> attn_in, attn_x, attn_inv_rms, q_latent, kv_latent, q, k, v, probs, lse, context;
    DeviceArray<float> ffn_in, ffn_inv_rms, topk_weights;
    DeviceArray<bf16> ffn_x;
    DeviceArray<int32_t> topk_ids, counts;
    // The router's selection bias: f64 as the CPU keeps it, and the f32 copy the router reads.
    DeviceArray<double> bias64;
    DeviceArray<float> bias;
  };

  TrainConfig config;
  ModelConfig c;
  int device = 0;
  int64_t N = 0;  // tokens per batch
  cublasHandle_t cublas = nullptr;
  std::vector<DeviceParam> params;
  std::vector<Layer> layers;
  int64_t moe_layers = 0;
  int64_t steps_taken = 0;
  // The engine's stream: every kernel, cuBLAS call and moka layer/router call of a step. A
  // blocking stream, so the engine's host copies (cudaMemcpy) stay ordered with it.
  cudaStream_t stream = nullptr;
  // cuBLAS's workspace, set by the engine so that a captured step allocates nothing.
  DeviceArray<unsigned char> cublas_workspace;

  // A step's inputs in one device block, copied in one transfer from a pinned staging copy:
  // StepScalars, then tokens [N], targets [N], embedding offsets [V+1] and positions [N] (each
  // token's positions in ascending order: the embedding backward sums them in the CPU
  // reference's order without atomics).
  static constexpr int64_t kScalarWords = sizeof(cuda::StepScalars) / sizeof(int32_t);
  int64_t input_words = 0;
  DeviceArray<int32_t> inputs;
  PinnedArray<int32_t> staging;
  cudaEvent_t staging_copied = nullptr;  // the last copy out of `staging` has run
  cuda::StepScalars scalars_now;
  const cuda::StepScalars* step_scalars() const { return reinterpret_cast<const cuda::StepScalars*>(inputs.data()); }
  const int32_t* tokens() const { return inputs.data() + kScalarWords; }
  const int32_t* targets() const { return tokens() + N; }
  const int32_t* embed_offsets() const { return targets() + N; }
  const int32_t* embed_positions() const { return embed_offsets() + c.vocab + 1; }

  // Scratch.
  DeviceArray<float> h, d_res, d_tmp, branch, final_x, final_inv_rms, logits, d_logits, row_loss, d_topk_weights;
  DeviceArray<float> d_context, dq, dk, dv, d_q_latent, d_kv_latent, stats_x, stats_logits;
  // The attention backward's scratch: d_scores [B*H, S, S] (reference) or row_dot [B*H, S] (fused).
  DeviceArray<float> d_scores, row_dot;
  DeviceArray<bf16> moe_out, d_out16, dx16, dx_router16;
  DeviceArray<bf16> matmul16[2];  // with bf16 matmuls: the bf16 activation and gradient operands
  DeviceArray<double> partials, scalars;  // scalars: [0] cross-entropy, [1] grad sum of squares, [2] stats
  DeviceArray<double> router_losses_dev;  // per MoE layer {aux, z} of the last forward
  DeviceArray<float> gain_partials;       // the norm backward's scratch
  DeviceParam *embed = nullptr, *final_norm = nullptr, *head = nullptr;
  // The optimizer's view of every tensor (a device table of slots, one AdamW launch).
  std::vector<cuda::TensorSlot> slots;
  DeviceArray<cuda::TensorSlot> slot_table;
  int64_t adamw_blocks = 0;

  // The captured step, replayed from the second step on (TrainConfig::cuda_graph).
  cudaGraphExec_t graph = nullptr;
  bool warmed_up = false;  // an eager step has run: workspaces and library state are in place
  // Profiling (TrainConfig::profile).
  StepProfile profile;
  std::unique_ptr<DeviceStageClock> clock;
  std::vector<DeviceStageClock::Mark> graph_marks;  // the captured step's marks
  int64_t host_syncs = 0;  // the device waits inside steps so far
  // The fused attention kernels, where asked for and they take the head_dim (else the reference).
  bool fused_attention = false;

  Impl(const TrainConfig& cfg, const std::vector<TensorRule>& rules) : config(cfg), c(cfg.model) {
    require(cuda_backend_available(), ErrorCode::backend_unavailable,
            "--backend cuda: no CUDA device is visible (or moka was built without CUDA)");
    c.validate();
    MOKA_CUDA_CHECK(cudaGetDevice(&device));
    MOKA_CUDA_CHECK(cudaStreamCreate(&stream));
    MOKA_CUBLAS_CHECK(cublasCreate(&cublas));
    MOKA_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    constexpr size_t kCublasWorkspace = size_t(32) << 20;  // what cuBLAS asks for on Hopper
    cublas_workspace = DeviceArray<unsigned char>(kCublasWorkspace);
    MOKA_CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_workspace.data(), kCublasWorkspace));
    N = cfg.batch * cfg.seq;
    require(N > 0, ErrorCode::invalid_argument, "the batch holds no tokens");
    fused_attention = cfg.fused_attention && cuda::flash_attention_supports(c.head_dim);

    // Initial weights from the host initializer: the same values the CPU engine starts from.
    ParamStore<float> host(rules);
    host.initialize(cfg.seed);
    params.reserve(rules.size());
    for (size_t i = 0; i < rules.size(); ++i) {
      DeviceParam p;
      p.rule = rules[i];
      p.n = rules[i].spec.numel();
      p.value = DeviceArray<float>(p.n);
      p.value.upload(host[i].value.data(), p.n);
      p.m = DeviceArray<float>(p.n);
      p.v = DeviceArray<float>(p.n);
      MOKA_CUDA_CHECK(cudaMemset(p.m.data(), 0, p.n * sizeof(float)));
      MOKA_CUDA_CHECK(cudaMemset(p.v.data(), 0, p.n * sizeof(float)));
      if (cfg.ema_decay > 0) {
        p.ema = DeviceArray<float>(p.n);
        MOKA_CUDA_CHECK(cudaMemcpy(p.ema.data(), p.value.data(), p.n * sizeof(float), cudaMemcpyDeviceToDevice));
      }
      if (read_by_moka_layer(rules[i].spec.cls)) {
        require(rules[i].forward_multiplier == 1.0, ErrorCode::invalid_argument,
                rules[i].spec.name + " is computed by a moka layer and cannot take a forward multiplier");
        p.shadow = DeviceArray<bf16>(p.n);
        p.grad16 = DeviceArray<bf16>(p.n);
      } else {
        p.grad = DeviceArray<float>(p.n);
      }
      params.push_back(std::move(p));
    }
    refresh_shadows();
    embed = &at("embed");
    final_norm = &at("final_norm");
    head = &at("head");
    build_layers();
    add_matmul_shadows();
    allocate_scratch();
    build_slots();
    if (cfg.profile) {
      profile.clock = "cuda events";
      profile.mode = cfg.cuda_graph ? "cuda graph" : "eager";
      clock = std::make_unique<DeviceStageClock>(stream, profile);
    }
  }

  ~Impl() {
    // The layers and routers (and their saved contexts) free stream-ordered scratch on `stream`:
    // they go before it does.
    cudaStreamSynchronize(stream);
    if (graph) cudaGraphExecDestroy(graph);
    clock.reset();
    layers.clear();
    if (staging_copied) cudaEventDestroy(staging_copied);
    cublasDestroy(cublas);
    cudaStreamDestroy(stream);
  }

  DeviceParam& at(const std::string& name) {
    for (auto& p : params)
      if (p.rule.spec.name == name) return p;
    throw Error(ErrorCode::invalid_argument, "the model has no tensor '" + name + "'");
  }

  void build_layers() {
    const int64_t W = c.attention_width(), S = config.seq, B = config.batch;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      Layer L;
      L.is_moe = l > 0;
      L.attn_norm = &at(p + "attn_norm");
      L.ffn_norm = &at(p + "ffn_norm");
      const std::vector<std::string> names = c.attention == AttentionKind::mla
          ? std::vector<std::string>{"q_down", "q_up", "kv_down", "k_up", "v_up"}
          : std::vector<std::string>{"q", "k", "v"};
      for (const auto& n : names) L.attn.push_back(&at(p + "attn." + n));
      L.attn_out = &at(p + "attn.out");
      const std::string f = L.is_moe ? p + "moe." : p + "ffn.";
      L.gate = &at(f + "gate");
      L.up = &at(f + "up");
      L.down = &at(f + "down");
      // Layer 0's dense FFN is a one-expert, top-1 moka layer with route weight 1, as on the CPU.
      MoeShape shape{c.d_model, c.dense_intermediate, 1, 1, 0, Activation::swiglu, 7.0f};
      if (L.is_moe) {
        shape = {c.d_model, c.expert_intermediate, c.num_experts, c.top_k, c.shared_intermediate, Activation::swiglu,
                 7.0f};
        L.router = &at(f + "router");
        if (c.shared_intermediate > 0) {
          L.shared_gate = &at(f + "shared_gate");
          L.shared_up = &at(f + "shared_up");
          L.shared_down = &at(f + "shared_down");
        }
        const RouterConfig rc{c.d_model, c.num_experts, c.top_k, ScoreFunction::sigmoid, true, true, 1.0, 0.0,
                              c.z_loss_coef};
        L.router_op = make_router(rc, Backend::cuda);
        L.moe_index = int(moe_layers++);
        L.bias64 = DeviceArray<double>(c.num_experts);
        L.bias = DeviceArray<float>(c.num_experts);
        L.counts = DeviceArray<int32_t>(c.num_experts);
        MOKA_CUDA_CHECK(cudaMemset(L.bias64.data(), 0, c.num_experts * sizeof(double)));
        MOKA_CUDA_CHECK(cudaMemset(L.bias.data(), 0, c.num_experts * sizeof(float)));
      }
      L.experts = shape.num_experts;
      L.top_k = shape.top_k;
      L.intermediate = shape.intermediate;
      L.ffn = make_moe_layer(shape, Backend::cuda);
      L.attn_in = DeviceArray<float>(N * c.d_model);
      L.attn_x = DeviceArray<float>(N * c.d_model);
      L.attn_inv_rms = DeviceArray<float>(N);
      if (c.attention == AttentionKind::mla) {
        L.q_latent = DeviceArray<float>(N * c.q_rank);
        L.kv_latent = DeviceArray<float>(N * c.kv_rank);
      }
      L.q = DeviceArray<float>(N * W);
      L.k = DeviceArray<float>(N * W);
      L.v = DeviceArray<float>(N * W);
      if (fused_attention)
        L.lse = DeviceArray<float>(B * c.num_heads * S);
      else
        L.probs = DeviceArray<float>(B * c.num_heads * S * S);
      L.context = DeviceArray<float>(N * W);
      L.ffn_in = DeviceArray<float>(N * c.d_model);
      L.ffn_inv_rms = DeviceArray<float>(N);
      L.ffn_x = DeviceArray<bf16>(N * c.d_model);
      L.topk_ids = DeviceArray<int32_t>(N * L.top_k);
      L.topk_weights = DeviceArray<float>(N * L.top_k);
      if (!L.is_moe) {
        const std::vector<int32_t> zeros(N, 0);
        const std::vector<float> ones(N, 1.0f);
        L.topk_ids.upload(zeros.data(), N);
        L.topk_weights.upload(ones.data(), N);
      }
      layers.push_back(std::move(L));
    }
  }

  // With bf16 matmuls, the projections and the LM head read bf16 copies of their weights, which
  // the AdamW launch refreshes with the moka layers' copies.
  void add_matmul_shadows() {
    if (!config.bf16_matmuls) return;
    std::vector<DeviceParam*> matmul_weights{head};
    for (auto& L : layers) {
      matmul_weights.insert(matmul_weights.end(), L.attn.begin(), L.attn.end());
      matmul_weights.push_back(L.attn_out);
    }
    for (DeviceParam* p : matmul_weights) {
      p->shadow = DeviceArray<bf16>(p->n);
      cuda::to_bf16(p->value.data(), p->n, p->shadow.data(), stream);
    }
    MOKA_CUDA_CHECK_LAUNCH();
  }

  void allocate_scratch() {
    const int64_t d = c.d_model, W = c.attention_width(), V = c.vocab;
    input_words = kScalarWords + 3 * N + V + 1;
    inputs = DeviceArray<int32_t>(input_words);
    staging = PinnedArray<int32_t>(input_words, PinnedArray<int32_t>::unmapped);
    MOKA_CUDA_CHECK(cudaEventCreateWithFlags(&staging_copied, cudaEventDisableTiming));
    for (auto* a : {&h, &d_res, &d_tmp, &branch, &final_x, &stats_x}) *a = DeviceArray<float>(N * d);
    final_inv_rms = DeviceArray<float>(N);
    logits = DeviceArray<float>(N * V);
    d_logits = DeviceArray<float>(N * V);
    row_loss = DeviceArray<float>(N);
    d_topk_weights = DeviceArray<float>(N * c.top_k);
    for (auto* a : {&d_context, &dq, &dk, &dv}) *a = DeviceArray<float>(N * W);
    if (c.attention == AttentionKind::mla) {
      d_q_latent = DeviceArray<float>(N * c.q_rank);
      d_kv_latent = DeviceArray<float>(N * c.kv_rank);
    }
    if (fused_attention)
      row_dot = DeviceArray<float>(config.batch * c.num_heads * config.seq);
    else
      d_scores = DeviceArray<float>(config.batch * c.num_heads * config.seq * config.seq);
    stats_logits = DeviceArray<float>(N * c.num_experts);
    for (auto* a : {&moe_out, &d_out16, &dx16, &dx_router16}) *a = DeviceArray<bf16>(N * d);
    if (config.bf16_matmuls) {
      const int64_t widest = std::max({d, W, V, c.q_rank, c.kv_rank});
      for (auto& m : matmul16) m = DeviceArray<bf16>(N * widest);
    }
    partials = DeviceArray<double>(std::max<int64_t>(int64_t(params.size()), 1) * cuda::kReduceBlocks);
    scalars = DeviceArray<double>(4);
    router_losses_dev = DeviceArray<double>(std::max<int64_t>(2 * moe_layers, 1));
    gain_partials = DeviceArray<float>(cuda::kNormGainChunks * d);
  }

  void build_slots() {
    for (auto& p : params) {
      cuda::TensorSlot t;
      t.value = p.value.data();
      t.m = p.m.data();
      t.v = p.v.data();
      t.ema = p.ema.data();
      t.shadow = p.shadow.empty() ? nullptr : p.shadow.data();
      t.grad = p.grad_data();
      t.grad_bf16 = p.bf16_grad();
      t.n = p.n;
      t.lr_multiplier = p.rule.lr_multiplier;
      t.weight_decay_multiplier = p.rule.weight_decay_multiplier;
      slots.push_back(t);
    }
    adamw_blocks = cuda::assign_adamw_blocks(slots.data(), int(slots.size()));
    slot_table = DeviceArray<cuda::TensorSlot>(slots.size());
    slot_table.upload(slots);
  }

  void refresh_shadows() {
    for (auto& p : params)
      if (!p.shadow.empty()) cuda::to_bf16(p.value.data(), p.n, p.shadow.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  // --- cuBLAS, column-major views of row-major matrices; operands f32 on TF32 tensor cores, or
  // bf16 (`bf16_operands`) on bf16 tensor cores; C f32, fp32 accumulation either way.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha, const void* A,
            int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc, bool bf16_operands = false) {
    const cudaDataType operand = bf16_operands ? CUDA_R_16BF : CUDA_R_32F;
    MOKA_CUBLAS_CHECK(cublasGemmEx(cublas, ta, tb, int(m), int(n), int(k), &alpha, A, operand, int(lda), B, operand,
                                   int(ldb), &beta, C, CUDA_R_32F, int(ldc),
                                   bf16_operands ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32,
                                   CUBLAS_GEMM_DEFAULT));
  }
  // With bf16 matmuls: the bf16 copy of an f32 activation or gradient of n elements, in one of the
  // two operand buffers.
  const bf16* matmul_operand(const float* x, int64_t n, int buffer) {
    cuda::to_bf16(x, n, matmul16[buffer].data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    return matmul16[buffer].data();
  }
  // y [rows, out] = fwd * x W^T;  W: [out, in].
  void linear(const float* x, const DeviceParam& w, float* y) {
    const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
    if (config.bf16_matmuls)
      gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, N, in, w.fwd(), w.shadow.data(), in, matmul_operand(x, N * in, 0), in, 0.0f,
           y, out, true);
    else
      gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, N, in, w.fwd(), w.value.data(), in, x, in, 0.0f, y, out);
  }
  // dx = fwd * dy W (added to dx when `accumulate`); dW = fwd * dy^T x (overwritten).
  void linear_backward(const float* x, DeviceParam& w, const float* dy, float* dx, bool accumulate) {
    const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
    const bool b16 = config.bf16_matmuls;
    const void* W = b16 ? static_cast<const void*>(w.shadow.data()) : w.value.data();
    const void* X = b16 ? static_cast<const void*>(matmul_operand(x, N * in, 0)) : x;
    const void* dY = b16 ? static_cast<const void*>(matmul_operand(dy, N * out, 1)) : dy;
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, in, N, out, w.fwd(), W, in, dY, out, accumulate ? 1.0f : 0.0f, dx, in, b16);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, in, out, N, w.fwd(), X, in, dY, out, 0.0f, w.grad.data(), in, b16);
  }
  double mean_abs(const void* x, bool is_bf16, int64_t n) {
    cuda::reduce_partials(cuda::ReduceOp::abs, x, is_bf16, n, partials.data(), stream);
    cuda::reduce_finish(partials.data(), cuda::kReduceBlocks, 1.0 / double(n), scalars.data() + 2, stream);
    return read_scalar(2);
  }
  // Waits for the stream, then reads scalars[i] (a host synchronization, counted).
  double read_scalar(int i) {
    double out = 0;
    wait_for_device();
    MOKA_CUDA_CHECK(cudaMemcpy(&out, scalars.data() + i, sizeof(double), cudaMemcpyDeviceToHost));
    return out;
  }
  void wait_for_device() {
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    ++host_syncs;
  }
  void mark(Stage s) {
    if (clock) clock->mark(s);
  }

  // The FFN's gate, up, down and shared gate, up, down as bf16 device views of the weights
  // (`grads` false) or of the gradients; the shared ones empty without a shared expert.
  std::array<TensorView, 6> ffn_views(const Layer& L, bool grads) const {
    const int64_t H = c.d_model, E = L.experts, I = L.intermediate, Is = c.shared_intermediate;
    auto view = [&](const DeviceParam* p, std::initializer_list<int64_t> dims) {
      return p ? dev_view(grads ? p->grad16.data() : p->shadow.data(), DType::bf16, dims) : TensorView();
    };
    return {view(L.gate, {E, I, H}),          view(L.up, {E, I, H}),          view(L.down, {E, H, I}),
            view(L.shared_gate, {Is, H}), view(L.shared_up, {Is, H}), view(L.shared_down, {H, Is})};
  }
  MoeWeights ffn_weights(const Layer& L) const {
    const auto v = ffn_views(L, false);
    return {v[0], v[1], v[2], v[3], v[4], v[5]};
  }

  TensorView dev_view(void* p, DType t, std::initializer_list<int64_t> dims) const {
    return TensorView(p, t, dims, Device::cuda(device));
  }

  // The batch and the step's scalars into the device's input block: a host-side counting sort
  // (each token's positions), the pinned staging copy, one asynchronous transfer. The host waits
  // only when the previous transfer out of the staging copy has not run yet.
  void stage_inputs(const Batch& b) {
    require(b.tokens() == N && int64_t(b.inputs.size()) == N && int64_t(b.targets.size()) == N,
            ErrorCode::shape_mismatch,
            "the CUDA engine was sized for " + std::to_string(N) + " tokens per batch, got " + std::to_string(b.tokens()));
    const int64_t V = c.vocab;
    for (int32_t t : b.inputs)
      require(t >= 0 && t < V, ErrorCode::invalid_argument, "token id " + std::to_string(t) + " outside vocab");
    if (cudaEventQuery(staging_copied) == cudaErrorNotReady) {
      MOKA_CUDA_CHECK(cudaEventSynchronize(staging_copied));
      ++host_syncs;
    }
    int32_t* words = staging.host();
    std::memcpy(words, &scalars_now, sizeof scalars_now);
    int32_t* tok = words + kScalarWords;
    int32_t* tgt = tok + N;
    int32_t* offsets = tgt + N;
    int32_t* positions = offsets + V + 1;
    std::copy(b.inputs.begin(), b.inputs.end(), tok);
    std::copy(b.targets.begin(), b.targets.end(), tgt);
    std::fill(offsets, offsets + V + 1, 0);
    for (int32_t t : b.inputs) ++offsets[t + 1];
    for (int64_t v = 0; v < V; ++v) offsets[v + 1] += offsets[v];
    std::vector<int32_t> fill(offsets, offsets + V);
    for (int64_t t = 0; t < N; ++t) positions[fill[b.inputs[t]]++] = int32_t(t);
    MOKA_CUDA_CHECK(cudaMemcpyAsync(inputs.data(), words, input_words * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    MOKA_CUDA_CHECK(cudaEventRecord(staging_copied, stream));
  }

  void attention_forward(Layer& L) {
    const float* x = L.attn_x.data();
    if (c.attention == AttentionKind::mla) {
      linear(x, *L.attn[0], L.q_latent.data());
      linear(L.q_latent.data(), *L.attn[1], L.q.data());
      linear(x, *L.attn[2], L.kv_latent.data());
      linear(L.kv_latent.data(), *L.attn[3], L.k.data());
      linear(L.kv_latent.data(), *L.attn[4], L.v.data());
    } else {
      linear(x, *L.attn[0], L.q.data());
      linear(x, *L.attn[1], L.k.data());
      linear(x, *L.attn[2], L.v.data());
    }
    if (fused_attention)
      cuda::flash_attention_forward(L.q.data(), L.k.data(), L.v.data(), config.batch, config.seq, c.num_heads,
                                    c.head_dim, L.lse.data(), L.context.data(), stream);
    else
      cuda::attention_forward(L.q.data(), L.k.data(), L.v.data(), config.batch, config.seq, c.num_heads, c.head_dim,
                              L.probs.data(), L.context.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    linear(L.context.data(), *L.attn_out, branch.data());
  }

  // d_res holds the gradient of the attention branch output; adds the gradient of attn_x's
  // RMSNorm input into d_res (and its bf16 copy into d_out16, the next FFN backward's input).
  void attention_backward(Layer& L) {
    mark(Stage::attention_backward);
    linear_backward(L.context.data(), *L.attn_out, d_res.data(), d_context.data(), false);
    if (fused_attention)
      cuda::flash_attention_backward(L.q.data(), L.k.data(), L.v.data(), L.context.data(), L.lse.data(),
                                     d_context.data(), config.batch, config.seq, c.num_heads, c.head_dim,
                                     row_dot.data(), dq.data(), dk.data(), dv.data(), stream);
    else
      cuda::attention_backward(L.q.data(), L.k.data(), L.v.data(), L.probs.data(), d_context.data(), config.batch,
                               config.seq, c.num_heads, c.head_dim, d_scores.data(), dq.data(), dk.data(), dv.data(),
                               stream);
    MOKA_CUDA_CHECK_LAUNCH();
    const float* x = L.attn_x.data();
    float* dx = d_tmp.data();
    if (c.attention == AttentionKind::mla) {
      linear_backward(L.kv_latent.data(), *L.attn[3], dk.data(), d_kv_latent.data(), false);
      linear_backward(L.kv_latent.data(), *L.attn[4], dv.data(), d_kv_latent.data(), true);
      linear_backward(x, *L.attn[2], d_kv_latent.data(), dx, false);
      linear_backward(L.q_latent.data(), *L.attn[1], dq.data(), d_q_latent.data(), false);
      linear_backward(x, *L.attn[0], d_q_latent.data(), dx, true);
    } else {
      linear_backward(x, *L.attn[0], dq.data(), dx, false);
      linear_backward(x, *L.attn[1], dk.data(), dx, true);
      linear_backward(x, *L.attn[2], dv.data(), dx, true);
    }
    mark(Stage::norms_backward);
    cuda::NormGrad dy;
    dy.f32 = dx;
    cuda::rmsnorm_backward(L.attn_in.data(), L.attn_norm->value.data(), L.attn_inv_rms.data(), dy, N, c.d_model, true,
                           d_res.data(), d_out16.data(), L.attn_norm->grad.data(), gain_partials.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  void ffn_forward(Layer& L, ActivationStats* stats) {
    const int64_t H = c.d_model, k = L.top_k, E = L.experts;
    if (L.is_moe) {
      const RouterOutputs out{dev_view(L.topk_ids.data(), DType::i32, {N, k}),
                              dev_view(L.topk_weights.data(), DType::f32, {N, k}),
                              dev_view(L.counts.data(), DType::i32, {E})};
      L.router_ctx = L.router_op->forward(dev_view(L.ffn_x.data(), DType::bf16, {N, H}), dev_view(L.router->shadow.data(), DType::bf16, {E, H}),
                                          dev_view(L.bias.data(), DType::f32, {E}), out, Stream{stream});
      if (stats) {
        // The CPU reference's router logits: the fp32 normed input times the fp32 router.
        cuda::residual_rmsnorm_forward(L.ffn_in.data(), {}, nullptr, nullptr, L.ffn_norm->value.data(), N, H,
                                       float(c.norm_eps), stats_x.data(), nullptr, L.ffn_inv_rms.data(), stream);
        gemm(CUBLAS_OP_T, CUBLAS_OP_N, E, N, H, 1.0f, L.router->value.data(), H, stats_x.data(), H, 0.0f,
             stats_logits.data(), E);
        stats->router_logits += mean_abs(stats_logits.data(), false, N * E);
      }
    }
    const MoeInputs in{dev_view(L.ffn_x.data(), DType::bf16, {N, H}), dev_view(L.topk_ids.data(), DType::i32, {N, k}),
                       dev_view(L.topk_weights.data(), DType::f32, {N, k})};
    L.ffn_ctx = L.ffn->forward(in, ffn_weights(L), dev_view(moe_out.data(), DType::bf16, {N, H}), Stream{stream});
    if (stats && L.is_moe) stats->moe_output += mean_abs(moe_out.data(), true, N * H);
  }

  // d_out16 holds the gradient of the FFN branch output (bf16, from the norm backward that wrote
  // d_res); adds the gradient of the FFN's RMSNorm input into d_res.
  void ffn_backward(Layer& L) {
    mark(Stage::moe_backward);
    const int64_t H = c.d_model, k = L.top_k, E = L.experts;
    const auto d = ffn_views(L, true);
    const MoeGradients g{dev_view(dx16.data(), DType::bf16, {N, H}), dev_view(d_topk_weights.data(), DType::f32, {N, k}),
                         d[0], d[1], d[2], d[3], d[4], d[5]};
    L.ffn->backward(*L.ffn_ctx, dev_view(d_out16.data(), DType::bf16, {N, H}), ffn_weights(L), g, Stream{stream});
    // The norm's input gradient: dx (+ the router's dx), summed in fp32 in that order as on the CPU.
    cuda::NormGrad dy;
    dy.b16[0] = dx16.data();
    if (L.is_moe) {
      L.router_op->backward(*L.router_ctx, dev_view(d_topk_weights.data(), DType::f32, {N, k}),
                            dev_view(dx_router16.data(), DType::bf16, {N, H}), dev_view(L.router->grad16.data(), DType::bf16, {E, H}), Stream{stream});
      dy.b16[1] = dx_router16.data();
    }
    mark(Stage::norms_backward);
    cuda::rmsnorm_backward(L.ffn_in.data(), L.ffn_norm->value.data(), L.ffn_inv_rms.data(), dy, N, H, true,
                           d_res.data(), nullptr, L.ffn_norm->grad.data(), gain_partials.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  // Through the cross-entropy, from the staged inputs; scalars[0] = mean cross-entropy and
  // router_losses_dev the routers' losses (on the device). The routers' contexts stay for
  // backward; release_contexts() frees them.
  void forward(ActivationStats* stats) {
    const int64_t H = c.d_model, V = c.vocab;
    const float eps = float(c.norm_eps);
    mark(Stage::embedding_forward);
    cuda::embed_forward(tokens(), embed->value.data(), embed->fwd(), N, H, h.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    if (stats) *stats = ActivationStats{mean_abs(h.data(), false, N * H)};
    // The residual stream h takes each branch's output in the norm that follows it.
    cuda::ResidualDelta pending;
    for (auto& L : layers) {
      mark(Stage::norms_forward);
      cuda::residual_rmsnorm_forward(h.data(), pending, pending.b16 ? h.data() : nullptr, L.attn_in.data(), L.attn_norm->value.data(), N, H,
                                     eps, L.attn_x.data(), nullptr, L.attn_inv_rms.data(), stream);
      mark(Stage::attention_forward);
      attention_forward(L);
      if (stats) stats->attention += mean_abs(branch.data(), false, N * H);
      mark(Stage::norms_forward);
      cuda::residual_rmsnorm_forward(h.data(), {branch.data(), nullptr}, h.data(), L.ffn_in.data(),
                                     L.ffn_norm->value.data(), N, H, eps, nullptr, L.ffn_x.data(),
                                     L.ffn_inv_rms.data(), stream);
      MOKA_CUDA_CHECK_LAUNCH();
      mark(Stage::moe_forward);
      ffn_forward(L, stats);
      pending = {nullptr, moe_out.data()};
    }
    mark(Stage::head_loss_forward);
    cuda::residual_rmsnorm_forward(h.data(), pending, h.data(), nullptr, final_norm->value.data(), N, H, eps,
                                   final_x.data(), nullptr, final_inv_rms.data(), stream);
    linear(final_x.data(), *head, logits.data());
    cuda::cross_entropy(logits.data(), targets(), N, V, row_loss.data(), d_logits.data(), stream);
    cuda::reduce_partials(cuda::ReduceOp::sum, row_loss.data(), false, N, partials.data(), stream);
    cuda::reduce_finish(partials.data(), cuda::kReduceBlocks, 1.0 / double(N), scalars.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    for (const auto& L : layers)
      if (L.is_moe)
        MOKA_CUDA_CHECK(cudaMemcpyAsync(router_losses_dev.data() + 2 * L.moe_index, L.router_ctx->device_losses(),
                                        2 * sizeof(double), cudaMemcpyDeviceToDevice, stream));
    if (stats) {
      stats->average_over_layers(c.num_layers);
      stats->residual = mean_abs(h.data(), false, N * H);
      stats->logits = mean_abs(logits.data(), false, N * V);
    }
  }

  void backward() {
    const int64_t H = c.d_model;
    mark(Stage::head_loss_backward);
    linear_backward(final_x.data(), *head, d_logits.data(), d_tmp.data(), false);
    cuda::NormGrad dy;
    dy.f32 = d_tmp.data();
    cuda::rmsnorm_backward(h.data(), final_norm->value.data(), final_inv_rms.data(), dy, N, H, false, d_res.data(),
                           d_out16.data(), final_norm->grad.data(), gain_partials.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      ffn_backward(*it);
      attention_backward(*it);
    }
    mark(Stage::embedding_backward);
    cuda::embed_backward(embed_offsets(), embed_positions(), d_res.data(), embed->fwd(), c.vocab, H, embed->grad.data(),
                         stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  // The routers' and layers' saved contexts are freed in stream order: inside a captured step,
  // their scratch is allocated and freed within the graph.
  void release_contexts() {
    for (auto& L : layers) {
      L.router_ctx.reset();
      L.ffn_ctx.reset();
    }
  }

  // AdamW (with the EMA update fused in) over every tensor: optimizer.cpp's arithmetic; the
  // gradient norm before clipping goes to scalars[1].
  void optimizer_step() {
    mark(Stage::optimizer);
    cuda::grad_square_partials(slot_table.data(), int(slots.size()), partials.data(), stream);
    cuda::reduce_finish(partials.data(), int64_t(slots.size()) * cuda::kReduceBlocks, 1.0, scalars.data() + 1, stream);
    cuda::adamw_update(cuda::AdamWHyper(config.adam, config.ema_decay), step_scalars(), scalars.data() + 1, slot_table.data(), int(slots.size()), adamw_blocks,
                       stream);
    MOKA_CUDA_CHECK_LAUNCH();
    mark(Stage::ema);  // fused into the AdamW launch on the GPU
  }

  void router_bias_step() {
    mark(Stage::router_bias);
    if (config.bias_update_rate <= 0) return;
    for (auto& L : layers)
      if (L.is_moe)
        cuda::update_selection_bias(L.counts.data(), L.experts, config.bias_update_rate, L.bias64.data(),
                                    L.bias.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  // Everything a step puts on the stream, from the staged inputs: no host synchronization (but
  // the coordinate check's `stats`) and no host state changed, so it can be captured.
  void step_body(ActivationStats* stats) {
    forward(stats);
    backward();
    release_contexts();
    optimizer_step();
    router_bias_step();
  }

  // Captures step_body into a graph (`count_only`: to count its launches, not to keep it).
  cudaGraph_t capture_step() {
    if (clock) clock->set_capture(true);
    MOKA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t captured = nullptr;
    try {
      step_body(nullptr);
      if (clock) graph_marks = clock->end();
    } catch (const Error& e) {
      cudaStreamEndCapture(stream, &captured);
      if (captured) cudaGraphDestroy(captured);
      if (clock) clock->set_capture(false);
      throw Error(e.code(), std::string("capturing the training step in a CUDA graph failed (--cuda-graph off runs "
                                        "it uncaptured): ") + e.what());
    }
    const cudaError_t end = cudaStreamEndCapture(stream, &captured);
    if (clock) clock->set_capture(false);
    require(end == cudaSuccess, ErrorCode::cuda,
            std::string("capturing the training step in a CUDA graph failed: a call in the step is not capturable (") +
                cudaGetErrorString(end) + "); --cuda-graph off runs it uncaptured");
    if (clock) {
      clock->count_launches(graph_marks, launches_in(captured) + 1);
      profile.launches[size_t(Stage::inputs)] = 1;  // the inputs' transfer, outside the graph
    }
    return captured;
  }

  // Reads the last step's numbers: one wait for the device, then small copies.
  void read_metrics(StepReport& r) {
    wait_for_device();
    std::array<double, 2> ce_and_norm{};
    MOKA_CUDA_CHECK(cudaMemcpy(ce_and_norm.data(), scalars.data(), sizeof ce_and_norm, cudaMemcpyDeviceToHost));
    r.cross_entropy = ce_and_norm[0];
    r.loss = r.cross_entropy + router_losses();
    r.grad_norm = std::sqrt(ce_and_norm[1]);
    r.load_max_over_mean = 0;
    for (const auto& cnt : expert_counts())
      r.load_max_over_mean = std::max(r.load_max_over_mean, load_stats(cnt).max_over_mean);
  }

  // The last forward's router losses, summed over the layers in order as the CPU does (the
  // caller has waited for the device).
  double router_losses() const {
    std::vector<double> losses(2 * moe_layers);
    if (moe_layers > 0)
      MOKA_CUDA_CHECK(cudaMemcpy(losses.data(), router_losses_dev.data(), losses.size() * sizeof(double),
                                 cudaMemcpyDeviceToHost));
    double total = 0;
    for (int64_t l = 0; l < moe_layers; ++l) total += losses[2 * l] + losses[2 * l + 1];
    return total;
  }

  std::vector<std::vector<int64_t>> expert_counts() const {
    std::vector<std::vector<int64_t>> out;
    for (const auto& L : layers)
      if (L.is_moe) {
        const auto counts = L.counts.download();
        out.emplace_back(counts.begin(), counts.end());
      }
    return out;
  }

  void run_step(const Batch& batch, double lr_factor, ActivationStats* stats, bool metrics, StepReport& r) {
    const auto host_start = std::chrono::steady_clock::now();
    const int64_t syncs_before = host_syncs;
    ++steps_taken;
    const auto& a = config.adam;
    scalars_now.lr = a.lr * lr_factor;
    scalars_now.bias_correction1 = float(1.0 - std::pow(a.beta1, double(steps_taken)));
    scalars_now.bias_correction2 = float(1.0 - std::pow(a.beta2, double(steps_taken)));
    // The profile starts from an idle device: the unprofiled steps' queued work is not a wait of
    // the profiled ones (profiling's own wait, not counted).
    if (clock && steps_taken == kUnprofiledSteps + 1) MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (clock) clock->new_step();
    mark(Stage::inputs);
    stage_inputs(batch);
    // The inputs mark; the step's own marks follow (the captured ones on a replay).
    std::vector<DeviceStageClock::Mark> marks;
    if (clock) marks = clock->take();
    if (config.cuda_graph && stats == nullptr && warmed_up) {
      if (!graph) {
        cudaGraph_t captured = capture_step();
        const cudaError_t made = cudaGraphInstantiate(&graph, captured, 0);
        cudaGraphDestroy(captured);
        require(made == cudaSuccess, ErrorCode::cuda,
                std::string("instantiating the captured training step failed: ") + cudaGetErrorString(made));
      }
      MOKA_CUDA_CHECK(cudaGraphLaunch(graph, stream));
      marks.insert(marks.end(), graph_marks.begin(), graph_marks.end());
    } else {
      // Eager profiling counts the launches once, from a capture of the step that never runs.
      if (clock && warmed_up && profile.launches_per_step < 0) cudaGraphDestroy(capture_step());
      step_body(stats);
      if (clock) {
        auto rest = clock->end();
        marks.insert(marks.end(), rest.begin(), rest.end());
      }
    }
    const double host_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count();
    if (metrics) read_metrics(r);
    // The first steps allocate workspaces and capture the graph: the profile starts after them.
    if (clock && steps_taken > kUnprofiledSteps) {
      MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));  // profiling's own wait, not counted
      clock->accumulate(marks);
      profile.host_ms += host_ms;
      profile.host_syncs += host_syncs - syncs_before;
    }
    warmed_up = true;
  }
  static constexpr int64_t kUnprofiledSteps = 2;

  void swap_ema() {
    for (auto& p : params) std::swap(p.value, p.ema);
    refresh_shadows();
  }
};

CudaEngine::CudaEngine(const TrainConfig& config, const std::vector<TensorRule>& rules)
    : impl_(std::make_unique<Impl>(config, rules)) {}

CudaEngine::~CudaEngine() = default;

void CudaEngine::step(const Batch& batch, double lr_factor, ActivationStats* stats, bool read_metrics,
                      StepReport& r) {
  impl_->run_step(batch, lr_factor, stats, read_metrics, r);
}

double CudaEngine::evaluate(const std::vector<Batch>& batches, bool use_ema) {
  auto& I = *impl_;
  if (use_ema) I.swap_ema();
  double total = 0;
  for (const auto& b : batches) {
    I.stage_inputs(b);
    I.forward(nullptr);
    I.release_contexts();
    total += I.read_scalar(0);
  }
  if (use_ema) I.swap_ema();
  return batches.empty() ? 0.0 : total / double(batches.size());
}

TrainState CudaEngine::state() const {
  const auto& I = *impl_;
  TrainState s;
  for (const auto& p : I.params) {
    s.values.push_back(p.value.download());
    s.adam_m.push_back(p.m.download());
    s.adam_v.push_back(p.v.download());
    if (!p.ema.empty()) s.ema.push_back(p.ema.download());
  }
  for (const auto& L : I.layers)
    if (L.is_moe) s.selection_biases.push_back(L.bias64.download());
  s.steps = I.steps_taken;
  return s;
}

void CudaEngine::set_state(const TrainState& s) {
  auto& I = *impl_;
  for (size_t i = 0; i < I.params.size(); ++i) {
    auto& p = I.params[i];
    p.value.upload(s.values[i].data(), p.n);
    p.m.upload(s.adam_m[i].data(), p.n);
    p.v.upload(s.adam_v[i].data(), p.n);
    if (!p.ema.empty()) p.ema.upload(s.ema[i].data(), p.n);
  }
  I.refresh_shadows();
  for (auto& L : I.layers)
    if (L.is_moe) {
      const auto& bias = s.selection_biases[L.moe_index];
      const std::vector<float> bias32(bias.begin(), bias.end());
      L.bias64.upload(bias);
      L.bias.upload(bias32);
    }
  I.steps_taken = s.steps;
}

double CudaEngine::forward_backward(const Batch& batch, double* cross_entropy) {
  auto& I = *impl_;
  I.stage_inputs(batch);
  I.forward(nullptr);
  I.backward();
  I.release_contexts();
  const double ce = I.read_scalar(0);
  if (cross_entropy) *cross_entropy = ce;
  return ce + I.router_losses();
}

StepProfile CudaEngine::profile() const { return impl_->profile; }

std::vector<std::vector<float>> CudaEngine::gradients() const {
  std::vector<std::vector<float>> out;
  for (const auto& p : impl_->params) {
    if (!p.bf16_grad()) {
      out.push_back(p.grad.download());
      continue;
    }
    const auto g16 = p.grad16.download();
    std::vector<float> g(g16.size());
    std::transform(g16.begin(), g16.end(), g.begin(), bf16_to_float);
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<std::vector<int32_t>> CudaEngine::routed_experts() const {
  std::vector<std::vector<int32_t>> out;
  for (const auto& L : impl_->layers)
    if (L.is_moe) out.push_back(L.topk_ids.download());
  return out;
}

void CudaEngine::poison_gradients() {
  // All-ones bytes are a NaN in both f32 and bf16.
  for (auto& p : impl_->params) {
    if (p.bf16_grad())
      MOKA_CUDA_CHECK(cudaMemset(p.grad16.data(), 0xFF, p.n * sizeof(bf16)));
    else
      MOKA_CUDA_CHECK(cudaMemset(p.grad.data(), 0xFF, p.n * sizeof(float)));
  }
}

std::unique_ptr<TrainEngine> make_cuda_engine(const TrainConfig& config, const std::vector<TensorRule>& rules) {
  return std::make_unique<CudaEngine>(config, rules);
}

}  // namespace moka::train
