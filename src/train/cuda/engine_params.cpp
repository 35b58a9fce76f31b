// The CUDA engine's state: construction (the parameters from the host initializer, with their
// AdamW moments, EMA, bf16 shadows and gradients; the layers with their moka MoE layers, routers
// and saved activations; the step's scratch; the optimizer's device table of tensors) and the
// optimizer step over it. engine_impl.hpp lists the other stages.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common/check.hpp"
#include "train/cuda/engine_impl.hpp"
#include "train/cuda/ops/adamw.cuh"
#include "train/cuda/ops/attention.cuh"
#include "train/cuda/ops/reduce.cuh"
#include "train/cuda/ops/rmsnorm.cuh"
#include "train/cuda/ops/to_bf16.cuh"

namespace moka::train {
namespace {

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

}  // namespace

CudaEngine::Impl::Impl(const TrainConfig& cfg, const std::vector<TensorRule>& rules) : config(cfg), c(cfg.model) {
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
    p.value.upload(host[i].value.data(), p.n, stream);
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

CudaEngine::Impl::~Impl() {
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

DeviceParam& CudaEngine::Impl::at(const std::string& name) {
  for (auto& p : params)
    if (p.rule.spec.name == name) return p;
  throw Error(ErrorCode::invalid_argument, "the model has no tensor '" + name + "'");
}

void CudaEngine::Impl::build_layers() {
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
      const RouterConfig rc{c.d_model, c.num_experts, c.top_k, ScoreFunction::sigmoid, true,
                            true,      1.0,           0.0,     c.z_loss_coef};
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
    if (fused_attention) L.lse = DeviceArray<float>(B * c.num_heads * S);
    else L.probs = DeviceArray<float>(B * c.num_heads * S * S);
    L.context = DeviceArray<float>(N * W);
    L.ffn_in = DeviceArray<float>(N * c.d_model);
    L.ffn_inv_rms = DeviceArray<float>(N);
    L.ffn_x = DeviceArray<bf16>(N * c.d_model);
    L.topk_ids = DeviceArray<int32_t>(N * L.top_k);
    L.topk_weights = DeviceArray<float>(N * L.top_k);
    if (!L.is_moe) {
      const std::vector<int32_t> zeros(N, 0);
      const std::vector<float> ones(N, 1.0f);
      L.topk_ids.upload(zeros.data(), N, stream);
      L.topk_weights.upload(ones.data(), N, stream);
    }
    layers.push_back(std::move(L));
  }
}

// With bf16 matmuls, the projections and the LM head read bf16 copies of their weights, which
// the AdamW launch refreshes with the moka layers' copies.
void CudaEngine::Impl::add_matmul_shadows() {
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

void CudaEngine::Impl::allocate_scratch() {
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
  if (fused_attention) row_dot = DeviceArray<float>(config.batch * c.num_heads * config.seq);
  else d_scores = DeviceArray<float>(config.batch * c.num_heads * config.seq * config.seq);
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

void CudaEngine::Impl::build_slots() {
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
  slot_table.upload(slots, stream);
}

void CudaEngine::Impl::refresh_shadows() {
  for (auto& p : params)
    if (!p.shadow.empty()) cuda::to_bf16(p.value.data(), p.n, p.shadow.data(), stream);
  MOKA_CUDA_CHECK_LAUNCH();
}

void CudaEngine::Impl::swap_ema() {
  for (auto& p : params) std::swap(p.value, p.ema);
  refresh_shadows();
}

// AdamW (with the EMA update fused in) over every tensor: optimizer.cpp's arithmetic; the
// gradient norm before clipping goes to scalars[1].
void CudaEngine::Impl::optimizer_step() {
  mark(Stage::optimizer);
  cuda::grad_square_partials(slot_table.data(), int(slots.size()), partials.data(), stream);
  cuda::reduce_finish(partials.data(), int64_t(slots.size()) * cuda::kReduceBlocks, 1.0, scalars.data() + 1, stream);
  cuda::adamw_update(cuda::AdamWHyper(config.adam, config.ema_decay), step_scalars(), scalars.data() + 1,
                     slot_table.data(), int(slots.size()), adamw_blocks, stream);
  MOKA_CUDA_CHECK_LAUNCH();
  mark(Stage::ema);  // fused into the AdamW launch on the GPU
}

}  // namespace moka::train
