#include "train/cuda_engine.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "train/cuda_kernels.cuh"

namespace moka::train {
namespace {

using cuda::bf16;

using ::moka::cuda::DeviceArray;

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
  DeviceArray<bf16> shadow, grad16;           // tensors of the moka layers
  bool bf16_path() const { return !shadow.empty(); }
  const void* grad_data() const { return bf16_path() ? static_cast<const void*>(grad16.data()) : grad.data(); }
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
    DeviceArray<float> attn_in, attn_x, attn_inv_rms, q_latent, kv_latent, q, k, v, probs, context;
    DeviceArray<float> ffn_in, ffn_inv_rms, topk_weights, bias;
    DeviceArray<bf16> ffn_x;
    DeviceArray<int32_t> topk_ids, counts;
  };

  TrainConfig config;
  ModelConfig c;
  int device = 0;
  int64_t N = 0;  // tokens per batch
  cublasHandle_t cublas = nullptr;
  std::vector<DeviceParam> params;
  std::vector<Layer> layers;
  std::vector<std::vector<double>> selection_bias;
  int64_t steps_taken = 0;
  // The engine's stream: every kernel, cuBLAS call and moka layer/router call of a step. A
  // blocking stream, so the engine's host copies (cudaMemcpy) stay ordered with it.
  cudaStream_t stream = nullptr;

  // Batch and scratch.
  DeviceArray<int32_t> tokens, targets, embed_offsets, embed_positions;
  DeviceArray<float> h, d_res, d_tmp, branch, final_x, final_inv_rms, logits, d_logits, row_loss, d_topk_weights;
  DeviceArray<float> d_context, dq, dk, dv, d_q_latent, d_kv_latent, d_scores, stats_x, stats_logits;
  DeviceArray<bf16> moe_out, d_out16, dx16, dx_router16;
  DeviceArray<double> partials, scalars;  // scalars: [0] cross-entropy, [1] grad sum of squares, [2] stats
  DeviceParam *embed = nullptr, *final_norm = nullptr, *head = nullptr;

  Impl(const TrainConfig& cfg, const std::vector<TensorRule>& rules) : config(cfg), c(cfg.model) {
    require(cuda_backend_available(), ErrorCode::backend_unavailable,
            "--backend cuda: no CUDA device is visible (or moka was built without CUDA)");
    c.validate();
    MOKA_CUDA_CHECK(cudaGetDevice(&device));
    MOKA_CUDA_CHECK(cudaStreamCreate(&stream));
    MOKA_CUBLAS_CHECK(cublasCreate(&cublas));
    MOKA_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    N = cfg.batch * cfg.seq;
    require(N > 0, ErrorCode::invalid_argument, "the batch holds no tokens");

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
    allocate_scratch();
  }

  ~Impl() {
    // The layers and routers (and their saved contexts) free stream-ordered scratch on `stream`:
    // they go before it does.
    cudaStreamSynchronize(stream);
    layers.clear();
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
        L.moe_index = int(selection_bias.size());
        selection_bias.emplace_back(c.num_experts, 0.0);
        L.bias = DeviceArray<float>(c.num_experts);
        L.counts = DeviceArray<int32_t>(c.num_experts);
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

  void allocate_scratch() {
    const int64_t d = c.d_model, W = c.attention_width(), V = c.vocab;
    tokens = DeviceArray<int32_t>(N);
    targets = DeviceArray<int32_t>(N);
    embed_offsets = DeviceArray<int32_t>(V + 1);
    embed_positions = DeviceArray<int32_t>(N);
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
    d_scores = DeviceArray<float>(config.batch * c.num_heads * config.seq * config.seq);
    stats_logits = DeviceArray<float>(N * c.num_experts);
    for (auto* a : {&moe_out, &d_out16, &dx16, &dx_router16}) *a = DeviceArray<bf16>(N * d);
    partials = DeviceArray<double>(std::max<int64_t>(int64_t(params.size()), 1) * cuda::kReduceBlocks);
    scalars = DeviceArray<double>(4);
  }

  void refresh_shadows() {
    for (auto& p : params)
      if (p.bf16_path()) cuda::to_bf16(p.value.data(), p.n, p.shadow.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  // --- cuBLAS, column-major views of row-major matrices; TF32 tensor cores, fp32 accumulation.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A,
            int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    MOKA_CUBLAS_CHECK(cublasGemmEx(cublas, ta, tb, int(m), int(n), int(k), &alpha, A, CUDA_R_32F, int(lda), B,
                                   CUDA_R_32F, int(ldb), &beta, C, CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F_FAST_TF32,
                                   CUBLAS_GEMM_DEFAULT));
  }
  // y [rows, out] = fwd * x W^T;  W: [out, in].
  void linear(const float* x, const DeviceParam& w, float* y) {
    const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, N, in, w.fwd(), w.value.data(), in, x, in, 0.0f, y, out);
  }
  // dx = fwd * dy W (added to dx when `accumulate`); dW = fwd * dy^T x (overwritten).
  void linear_backward(const float* x, DeviceParam& w, const float* dy, float* dx, bool accumulate) {
    const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, in, N, out, w.fwd(), w.value.data(), in, dy, out, accumulate ? 1.0f : 0.0f, dx, in);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, in, out, N, w.fwd(), x, in, dy, out, 0.0f, w.grad.data(), in);
  }
  void add(const float* x, int64_t n, float* y) {
    const float one = 1.0f;
    MOKA_CUBLAS_CHECK(cublasSaxpy(cublas, int(n), &one, x, 1, y, 1));
  }
  void copy(const float* src, int64_t n, float* dst) {
    MOKA_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
  double mean_abs(const void* x, bool is_bf16, int64_t n) {
    cuda::reduce_partials(cuda::ReduceOp::abs, x, is_bf16, n, partials.data(), stream);
    cuda::reduce_finish(partials.data(), cuda::kReduceBlocks, 1.0 / double(n), scalars.data() + 2, stream);
    double out = 0;
    MOKA_CUDA_CHECK(cudaMemcpy(&out, scalars.data() + 2, sizeof(double), cudaMemcpyDeviceToHost));
    return out;
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

  void upload_batch(const Batch& b) {
    require(b.tokens() == N && int64_t(b.inputs.size()) == N && int64_t(b.targets.size()) == N,
            ErrorCode::shape_mismatch,
            "the CUDA engine was sized for " + std::to_string(N) + " tokens per batch, got " + std::to_string(b.tokens()));
    const int64_t V = c.vocab;
    // Each token's positions in ascending order (a counting sort): the embedding backward
    // sums them in the CPU reference's order without atomics.
    std::vector<int32_t> offsets(V + 1, 0), positions(N);
    for (int32_t t : b.inputs) {
      require(t >= 0 && t < V, ErrorCode::invalid_argument, "token id " + std::to_string(t) + " outside vocab");
      ++offsets[t + 1];
    }
    for (int64_t v = 0; v < V; ++v) offsets[v + 1] += offsets[v];
    std::vector<int32_t> fill(offsets.begin(), offsets.end() - 1);
    for (int64_t t = 0; t < N; ++t) positions[fill[b.inputs[t]]++] = int32_t(t);
    tokens.upload(b.inputs.data(), N);
    targets.upload(b.targets.data(), N);
    embed_offsets.upload(offsets.data(), V + 1);
    embed_positions.upload(positions.data(), N);
    for (auto& L : layers)
      if (L.is_moe) {
        const auto& bd = selection_bias[L.moe_index];
        const std::vector<float> bf(bd.begin(), bd.end());
        L.bias.upload(bf.data(), int64_t(bf.size()));
      }
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
    cuda::attention_forward(L.q.data(), L.k.data(), L.v.data(), config.batch, config.seq, c.num_heads, c.head_dim,
                            L.probs.data(), L.context.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    linear(L.context.data(), *L.attn_out, branch.data());
  }

  // d_res holds the gradient of the attention branch output; adds the gradient of attn_x's
  // RMSNorm input into d_res.
  void attention_backward(Layer& L) {
    linear_backward(L.context.data(), *L.attn_out, d_res.data(), d_context.data(), false);
    cuda::attention_backward(L.q.data(), L.k.data(), L.v.data(), L.probs.data(), d_context.data(), config.batch,
                             config.seq, c.num_heads, c.head_dim, d_scores.data(), dq.data(), dk.data(), dv.data(), stream);
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
    cuda::rmsnorm_backward(L.attn_in.data(), L.attn_norm->value.data(), L.attn_inv_rms.data(), dx, N, c.d_model, true,
                           d_res.data(), L.attn_norm->grad.data(), stream);
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
        cuda::rmsnorm_forward(L.ffn_in.data(), L.ffn_norm->value.data(), N, H, float(c.norm_eps), stats_x.data(), nullptr,
                              L.ffn_inv_rms.data(), stream);
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

  // d_res holds the gradient of the FFN branch output; adds the gradient of the FFN's RMSNorm
  // input into d_res.
  void ffn_backward(Layer& L) {
    const int64_t H = c.d_model, k = L.top_k, E = L.experts;
    cuda::to_bf16(d_res.data(), N * H, d_out16.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    const auto d = ffn_views(L, true);
    const MoeGradients g{dev_view(dx16.data(), DType::bf16, {N, H}), dev_view(d_topk_weights.data(), DType::f32, {N, k}),
                         d[0], d[1], d[2], d[3], d[4], d[5]};
    L.ffn->backward(*L.ffn_ctx, dev_view(d_out16.data(), DType::bf16, {N, H}), ffn_weights(L), g, Stream{stream});
    // d_tmp = dx (+ the router's dx), summed in fp32 in that order as on the CPU.
    MOKA_CUDA_CHECK(cudaMemsetAsync(d_tmp.data(), 0, N * H * sizeof(float), stream));
    cuda::add_bf16(dx16.data(), N * H, d_tmp.data(), stream);
    if (L.is_moe) {
      L.router_op->backward(*L.router_ctx, dev_view(d_topk_weights.data(), DType::f32, {N, k}),
                            dev_view(dx_router16.data(), DType::bf16, {N, H}), dev_view(L.router->grad16.data(), DType::bf16, {E, H}), Stream{stream});
      cuda::add_bf16(dx_router16.data(), N * H, d_tmp.data(), stream);
    }
    cuda::rmsnorm_backward(L.ffn_in.data(), L.ffn_norm->value.data(), L.ffn_inv_rms.data(), d_tmp.data(), N, H, true,
                           d_res.data(), L.ffn_norm->grad.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  // Through the cross-entropy; scalars[0] = mean cross-entropy (on the device).
  void forward(const Batch& b, ActivationStats* stats) {
    upload_batch(b);
    const int64_t H = c.d_model, V = c.vocab;
    cuda::embed_forward(tokens.data(), embed->value.data(), embed->fwd(), N, H, h.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    if (stats) *stats = ActivationStats{mean_abs(h.data(), false, N * H)};
    for (auto& L : layers) {
      copy(h.data(), N * H, L.attn_in.data());
      cuda::rmsnorm_forward(L.attn_in.data(), L.attn_norm->value.data(), N, H, float(c.norm_eps), L.attn_x.data(),
                            nullptr, L.attn_inv_rms.data(), stream);
      attention_forward(L);
      if (stats) stats->attention += mean_abs(branch.data(), false, N * H);
      add(branch.data(), N * H, h.data());
      copy(h.data(), N * H, L.ffn_in.data());
      cuda::rmsnorm_forward(L.ffn_in.data(), L.ffn_norm->value.data(), N, H, float(c.norm_eps), nullptr, L.ffn_x.data(),
                            L.ffn_inv_rms.data(), stream);
      MOKA_CUDA_CHECK_LAUNCH();
      ffn_forward(L, stats);
      cuda::add_bf16(moe_out.data(), N * H, h.data(), stream);
      MOKA_CUDA_CHECK_LAUNCH();
    }
    cuda::rmsnorm_forward(h.data(), final_norm->value.data(), N, H, float(c.norm_eps), final_x.data(), nullptr,
                          final_inv_rms.data(), stream);
    linear(final_x.data(), *head, logits.data());
    cuda::cross_entropy(logits.data(), targets.data(), N, V, row_loss.data(), d_logits.data(), stream);
    cuda::reduce_partials(cuda::ReduceOp::sum, row_loss.data(), false, N, partials.data(), stream);
    cuda::reduce_finish(partials.data(), cuda::kReduceBlocks, 1.0 / double(N), scalars.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    if (stats) {
      stats->average_over_layers(c.num_layers);
      stats->residual = mean_abs(h.data(), false, N * H);
      stats->logits = mean_abs(logits.data(), false, N * V);
    }
  }

  void backward() {
    const int64_t H = c.d_model;
    linear_backward(final_x.data(), *head, d_logits.data(), d_tmp.data(), false);
    cuda::rmsnorm_backward(h.data(), final_norm->value.data(), final_inv_rms.data(), d_tmp.data(), N, H, false,
                           d_res.data(), final_norm->grad.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      ffn_backward(*it);
      attention_backward(*it);
    }
    cuda::embed_backward(embed_offsets.data(), embed_positions.data(), d_res.data(), embed->fwd(), c.vocab, H,
                         embed->grad.data(), stream);
    MOKA_CUDA_CHECK_LAUNCH();
  }

  double read_scalar(int i) const {
    double out = 0;
    MOKA_CUDA_CHECK(cudaMemcpy(&out, scalars.data() + i, sizeof(double), cudaMemcpyDeviceToHost));
    return out;
  }

  double router_losses() const {
    double total = 0;
    for (const auto& L : layers)
      if (L.router_ctx) total += L.router_ctx->losses().aux_loss + L.router_ctx->losses().z_loss;
    return total;
  }

  // AdamW over every tensor (optimizer.cpp's arithmetic); returns the gradient norm before clipping.
  double adamw_step(double lr_factor) {
    for (size_t i = 0; i < params.size(); ++i)
      cuda::reduce_partials(cuda::ReduceOp::square, params[i].grad_data(), params[i].bf16_path(), params[i].n,
                            partials.data() + i * cuda::kReduceBlocks, stream);
    cuda::reduce_finish(partials.data(), int64_t(params.size()) * cuda::kReduceBlocks, 1.0, scalars.data() + 1, stream);
    ++steps_taken;
    const auto& a = config.adam;
    cuda::AdamWArgs args;
    args.lr = a.lr * lr_factor;
    args.weight_decay = a.weight_decay;
    args.beta1 = float(a.beta1);
    args.beta2 = float(a.beta2);
    args.eps = float(a.eps);
    args.bias_correction1 = float(1.0 - std::pow(a.beta1, double(steps_taken)));
    args.bias_correction2 = float(1.0 - std::pow(a.beta2, double(steps_taken)));
    args.clip_norm = a.clip_norm;
    args.ema_decay = float(config.ema_decay);
    for (auto& p : params) {
      args.lr_multiplier = p.rule.lr_multiplier;
      args.weight_decay_multiplier = p.rule.weight_decay_multiplier;
      cuda::adamw_update(args, scalars.data() + 1, p.grad_data(), p.bf16_path(), p.n, p.value.data(), p.m.data(),
                         p.v.data(), p.ema.data(), p.bf16_path() ? p.shadow.data() : nullptr, stream);
    }
    MOKA_CUDA_CHECK_LAUNCH();
    return std::sqrt(read_scalar(1));
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

  void swap_ema() {
    for (auto& p : params) std::swap(p.value, p.ema);
    refresh_shadows();
  }
};

CudaEngine::CudaEngine(const TrainConfig& config, const std::vector<TensorRule>& rules)
    : impl_(std::make_unique<Impl>(config, rules)) {}

CudaEngine::~CudaEngine() = default;

void CudaEngine::step(const Batch& batch, double lr_factor, ActivationStats* stats, StepReport& r) {
  auto& I = *impl_;
  I.forward(batch, stats);
  I.backward();
  r.grad_norm = I.adamw_step(lr_factor);
  r.cross_entropy = I.read_scalar(0);
  r.loss = r.cross_entropy + I.router_losses();
  const auto counts = I.expert_counts();
  for (const auto& cnt : counts) r.load_max_over_mean = std::max(r.load_max_over_mean, load_stats(cnt).max_over_mean);
  if (I.config.bias_update_rate > 0)
    for (size_t i = 0; i < counts.size(); ++i)
      update_selection_bias(I.selection_bias[i], counts[i], I.config.bias_update_rate);
}

double CudaEngine::evaluate(const std::vector<Batch>& batches, bool use_ema) {
  auto& I = *impl_;
  if (use_ema) I.swap_ema();
  double total = 0;
  for (const auto& b : batches) {
    I.forward(b, nullptr);
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
  s.selection_biases = I.selection_bias;
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
  I.selection_bias = s.selection_biases;
  I.steps_taken = s.steps;
}

double CudaEngine::forward_backward(const Batch& batch, double* cross_entropy) {
  auto& I = *impl_;
  I.forward(batch, nullptr);
  I.backward();
  const double ce = I.read_scalar(0);
  if (cross_entropy) *cross_entropy = ce;
  return ce + I.router_losses();
}

std::vector<std::vector<float>> CudaEngine::gradients() const {
  std::vector<std::vector<float>> out;
  for (const auto& p : impl_->params) {
    if (!p.bf16_path()) {
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
    if (p.bf16_path())
      MOKA_CUDA_CHECK(cudaMemset(p.grad16.data(), 0xFF, p.n * sizeof(bf16)));
    else
      MOKA_CUDA_CHECK(cudaMemset(p.grad.data(), 0xFF, p.n * sizeof(float)));
  }
}

std::unique_ptr<TrainEngine> make_cuda_engine(const TrainConfig& config, const std::vector<TensorRule>& rules) {
  return std::make_unique<CudaEngine>(config, rules);
}

}  // namespace moka::train
