// The router on the GPU: logits = x W^T through cuBLAS (bf16 in, fp32 out), then one warp per
// token for scores, biased top-k (ties to the lower expert id, as the CPU reference), weights,
// and per-expert counts (integer atomics: exact). A warp, not a block: a token's few hundred
// scores need no block barriers, and a block per token spent most of the router's time in them. Losses and their gradients use fixed-order
// reductions. Only RouterContext::losses() synchronizes (it returns host numbers).
#include <cfloat>
#include <cmath>
#include <mutex>

#include "core/activation.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/common/stream.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/layer/layer_kernels.hpp"

namespace moka::cuda {
namespace {

constexpr int kThreads = 256;

struct RouterParams {
  int64_t tokens, experts, top_k;
  bool sigmoid, renormalize;
  float route_scale;
  double aux_coef, z_coef;
  // Whether the forward computes the balancing loss's probabilities and sums, and the z-loss's sum:
  // for a coefficient of RouterConfig's or for a caller's RouterAuxOutputs::losses.
  bool balance_on, z_on;
};

// Block-wide sum in a fixed order (lanes, then warps in order); every thread gets it.
__device__ double block_sum(double v) {
  __shared__ double part[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  double r = part[0];
  for (int w = 1; w < kThreads / 32; ++w) r += part[w];
  __syncthreads();
  return r;
}

constexpr int kWarps = kThreads / 32;  // tokens per block of the per-token kernels

// Warp-wide max or sum over a butterfly: lane i adds lane i^o's value to its own, and a + b is
// b + a bit for bit, so every lane ends with the same bits, in the same order every run.
__device__ float warp_reduce(float v, bool is_max) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, u) : v + u;
  }
  return v;
}

// Warp-wide argmax (higher key wins; equal keys: lower id); every lane gets the winner.
__device__ void warp_argmax(float& key, int& id) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float k2 = __shfl_xor_sync(0xffffffffu, key, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, id, o);
    if (k2 > key || (k2 == key && i2 < id)) key = k2, id = i2;
  }
}

// The token of this warp, or -1 past the last (the whole warp leaves together).
__device__ int64_t warp_token(int64_t tokens) {
  const int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  return t < tokens ? t : -1;
}

// One warp per token. scores: [T, E]; p: [T, E], the balancing loss's probabilities (null when
// neither the loss nor the caller needs them); lse: [T]; logits_out: the caller's copy of the
// logits (null: none). The ids go to the caller's topk_ids and to saved_ids, the copy backward
// reads (the caller may reuse its buffer).
__global__ void __launch_bounds__(kThreads)
    route_tokens(RouterParams P, const float* logits, const float* bias, float* scores, float* p, float* lse,
                 float* logits_out, int32_t* ids, int32_t* saved_ids, float* weights, int32_t* counts) {
  const int64_t t = warp_token(P.tokens);
  if (t < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t E = P.experts;
  const float* lg = logits + t * E;
  float* sc = scores + t * E;
  float mx = -FLT_MAX;
  for (int64_t e = lane; e < E; e += 32) {
    mx = fmaxf(mx, lg[e]);
    if (logits_out) logits_out[t * E + e] = lg[e];
  }
  mx = warp_reduce(mx, true);
  float sum_exp = 0;
  for (int64_t e = lane; e < E; e += 32) sum_exp += expf(lg[e] - mx);
  sum_exp = warp_reduce(sum_exp, false);
  if (lane == 0) lse[t] = mx + logf(sum_exp);
  for (int64_t e = lane; e < E; e += 32) sc[e] = P.sigmoid ? core::sigmoid(lg[e]) : expf(lg[e] - mx) / sum_exp;
  if (p) {  // the scores normalized per token
    float ssum = 0;
    for (int64_t e = lane; e < E; e += 32) ssum += sc[e];
    ssum = warp_reduce(ssum, false);
    for (int64_t e = lane; e < E; e += 32) p[t * E + e] = sc[e] / ssum;
  }
  __syncwarp();  // every lane's scores, before any lane reads another's
  // Top-k: k rounds of a warp argmax over experts not yet taken, in registers (no memory shared
  // between lanes): lane l owns experts l + 32 q and sets bit q of `taken` when one of them wins
  // (E <= 2048); lane j % 32 keeps round j's winner (k <= 64).
  float sel_sum = 0;
  uint64_t taken = 0;
  int winner_low = -1, winner_high = -1;  // rounds lane and lane + 32
  for (int64_t j = 0; j < P.top_k; ++j) {
    float key = -FLT_MAX;
    int id = INT_MAX;
    for (int64_t e = lane, q = 0; e < E; e += 32, ++q) {
      if ((taken >> q) & 1) continue;
      // A NaN score ranks lowest, so a valid id is always chosen; its NaN weight is then
      // reported by the layer's routing check instead of indexing past the experts.
      const float raw = sc[e] + (bias ? bias[e] : 0.0f);
      const float kv = isnan(raw) ? -FLT_MAX : raw;
      if (kv > key || (kv == key && e < id)) key = kv, id = static_cast<int>(e);
    }
    warp_argmax(key, id);
    if ((id & 31) == lane) taken |= uint64_t(1) << (id >> 5);
    if ((j & 31) == lane) (j < 32 ? winner_low : winner_high) = id;
    sel_sum += sc[id];
  }
  for (int64_t j = lane; j < P.top_k; j += 32) {
    const int e = j < 32 ? winner_low : winner_high;
    const float s = sc[e];
    ids[t * P.top_k + j] = e;
    saved_ids[t * P.top_k + j] = e;
    weights[t * P.top_k + j] = P.route_scale * (P.renormalize ? s / sel_sum : s);
    atomicAdd(&counts[e], 1);
  }
}

// The router's losses in double, every sum in a fixed order (same bits every run).
// router_loss_sums, blocks 0..E-1: sums[e] = mean_p of expert e, its column of p summed over the
// tokens by the whole block (a fixed order); block E: sums[E] = the mean of lse^2, summed
// likewise. A block per sum: one thread per expert over every token made this the router's
// slowest kernel.
__global__ void router_loss_sums(RouterParams P, const float* p, const float* lse, double* sums) {
  double s = 0;
  if (blockIdx.x < P.experts) {
    if (!P.balance_on) return;
    const int64_t e = blockIdx.x;
    for (int64_t t = threadIdx.x; t < P.tokens; t += blockDim.x) s += p[t * P.experts + e];
    s = block_sum(s);
    if (threadIdx.x == 0) sums[e] = s / double(P.tokens);
  } else {
    if (!P.z_on) return;
    for (int64_t t = threadIdx.x; t < P.tokens; t += blockDim.x) s += double(lse[t]) * lse[t];
    s = block_sum(s);
    if (threadIdx.x == 0) sums[P.experts] = s / double(P.tokens);
  }
}

// The losses from the sums and the counts, experts in order: with RouterConfig's coefficients
// into `losses` (device_losses()), without into the caller's aux_losses (null: not asked for).
// The counts also go out here, to the caller's expert_counts (int32 or int64) and added to its
// expert_load (any may be null), which saves the launches of a copy and of an accumulation.
__global__ void router_losses(RouterParams P, const int32_t* counts, const double* sums, double* losses,
                              float* aux_losses, int32_t* expert_counts32, int64_t* expert_counts64,
                              int64_t* expert_load) {
  for (int64_t e = threadIdx.x; e < P.experts; e += blockDim.x) {
    if (expert_counts32) expert_counts32[e] = counts[e];
    if (expert_counts64) expert_counts64[e] = counts[e];
    if (expert_load) expert_load[e] += counts[e];
  }
  if (threadIdx.x != 0) return;
  // A loss that is off is 0 and its sums did not run.
  double balance = 0;
  if (P.balance_on)
    for (int64_t e = 0; e < P.experts; ++e) balance += double(counts[e]) / double(P.tokens * P.top_k) * sums[e];
  balance *= double(P.experts);
  const double z = P.z_on ? sums[P.experts] : 0.0;
  losses[0] = P.aux_coef * balance;
  losses[1] = P.z_coef * z;
  if (aux_losses) aux_losses[0] = float(balance), aux_losses[1] = float(z);
}

// The caller's gradients of the RouterAuxOutputs (null: none given).
struct AuxGradientPointers {
  const float* d_logits = nullptr;
  const float* d_probs = nullptr;
  const float* d_losses = nullptr;  // {d balance, d z}, read here: no host copy
};

// d_logits of one token (bf16 for the cuBLAS products), mirroring the CPU router's backward; one
// warp per token, as the forward.
__global__ void __launch_bounds__(kThreads)
    router_backward_tokens(RouterParams P, const float* logits, const float* scores, const float* lse,
                           const int32_t* ids, const int32_t* counts, const float* d_weights, AuxGradientPointers aux,
                           float* ds_scratch, bf16* d_logits) {
  const int64_t t = warp_token(P.tokens);
  if (t < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t E = P.experts, k = P.top_k;
  const float* sc = scores + t * E;
  float* ds = ds_scratch + t * E;
  for (int64_t e = lane; e < E; e += 32) ds[e] = 0;
  __syncwarp();
  if (lane == 0) {  // the selected scores' gradients, j in order
    float S = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) S += sc[ids[t * k + j]], dot += d_weights[t * k + j] * sc[ids[t * k + j]];
    for (int64_t j = 0; j < k; ++j) {
      const float dw = d_weights[t * k + j];
      ds[ids[t * k + j]] += P.route_scale * (P.renormalize ? dw / S - dot / (S * S) : dw);
    }
  }
  __syncwarp();
  // Through p = s / sum(s): the balancing loss (RouterConfig's coefficient plus the caller's
  // gradient of the returned loss; the route fractions are constants) and the caller's d_probs.
  const double balance = P.aux_coef + (aux.d_losses ? double(aux.d_losses[0]) : 0.0);
  const float* dprob = aux.d_probs ? aux.d_probs + t * E : nullptr;
  if (balance != 0 || dprob) {
    auto dp_of = [&](int64_t e) {
      const float d = float(balance * double(E) * (double(counts[e]) / double(P.tokens * k)) / double(P.tokens));
      return dprob ? d + dprob[e] : d;
    };
    float ssum = 0, dpp = 0;
    for (int64_t e = lane; e < E; e += 32) ssum += sc[e];
    ssum = warp_reduce(ssum, false);
    for (int64_t e = lane; e < E; e += 32) dpp += dp_of(e) * sc[e] / ssum;
    dpp = warp_reduce(dpp, false);
    for (int64_t e = lane; e < E; e += 32) ds[e] += (dp_of(e) - dpp) / ssum;
  }
  float dot_sp = 0;
  if (!P.sigmoid) {
    for (int64_t e = lane; e < E; e += 32) dot_sp += ds[e] * sc[e];
    dot_sp = warp_reduce(dot_sp, false);
  }
  const double z = P.z_coef + (aux.d_losses ? double(aux.d_losses[1]) : 0.0);
  const float zc = float(2.0 * z / double(P.tokens)) * lse[t];
  for (int64_t e = lane; e < E; e += 32) {
    float dl = P.sigmoid ? ds[e] * sc[e] * (1.0f - sc[e]) : sc[e] * (ds[e] - dot_sp);
    if (z != 0) dl += zc * expf(logits[t * E + e] - lse[t]);
    if (aux.d_logits) dl += aux.d_logits[t * E + e];
    d_logits[t * E + e] = __float2bfloat16(dl);
  }
}

struct CudaRouterState final : RouterContext {
  RouterParams params{};
  const void* x = nullptr;
  const void* w_router = nullptr;
  cudaStream_t stream = nullptr;  // the forward's
  // Stream-ordered scratch: forward and backward of one context run on the same stream.
  std::unique_ptr<StreamScratch<float>> logits, scores, p, lse;
  std::unique_ptr<StreamScratch<int32_t>> ids, counts;
  std::unique_ptr<StreamScratch<double>> sums, losses_dev;
  bool wrote_logits = false, wrote_probs = false, wrote_losses = false;  // RouterAuxOutputs written
  RouterLosses losses() const override {
    double h[2];
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    MOKA_CUDA_CHECK(cudaMemcpy(h, losses_dev->data(), sizeof(h), cudaMemcpyDeviceToHost));
    return {h[0], h[1]};
  }
  const double* device_losses() const override { return losses_dev->data(); }
};

class CudaRouter final : public Router {
 public:
  explicit CudaRouter(const RouterConfig& c) : c_(c) {
    require(c.hidden > 0 && c.num_experts > 0 && c.top_k > 0, ErrorCode::invalid_argument,
            "router hidden, num_experts and top_k must be positive");
    require(c.top_k <= c.num_experts, ErrorCode::invalid_argument, "router top_k exceeds num_experts");
    require(c.top_k <= 64, ErrorCode::unsupported_size, "the CUDA router takes top_k <= 64");
    require(c.num_experts <= 2048, ErrorCode::unsupported_size, "the CUDA router takes num_experts <= 2048");
    require(std::isfinite(c.route_scale), ErrorCode::invalid_argument, "route_scale must be finite");
    MOKA_CUDA_CHECK(cudaGetDevice(&device_));
    MOKA_CUBLAS_CHECK(cublasCreate(&cublas_));
    workspace_ = DeviceArray<unsigned char>(kCublasWorkspace);
  }
  ~CudaRouter() override { cublasDestroy(cublas_); }
  const RouterConfig& config() const override { return c_; }

  std::unique_ptr<RouterContext> forward(const TensorView& x, const TensorView& w, const TensorView& bias,
                                         const RouterOutputs& out, Stream stream) override {
    const Device dev = Device::cuda(device_);
    require(x.rank == 2, ErrorCode::shape_mismatch, "router x must be [T, H], got " + x.shape_string());
    const int64_t T = x.dim(0), H = c_.hidden, E = c_.num_experts, k = c_.top_k;
    require(T >= 1, ErrorCode::invalid_argument, "the CUDA router needs at least one token");
    expect_tensor(x, "x", DType::bf16, dev, {T, H});
    expect_tensor(w, "w_router", DType::bf16, dev, {E, H});
    if (c_.use_selection_bias) expect_tensor(bias, "selection_bias", DType::f32, dev, {E});
    expect_tensor(out.topk_ids, "topk_ids", DType::i32, dev, {T, k});
    expect_tensor(out.topk_weights, "topk_weights", DType::f32, dev, {T, k});
    const bool counts64 = out.expert_counts.dtype == DType::i64;
    if (!out.expert_counts.empty())
      expect_tensor(out.expert_counts, "expert_counts", counts64 ? DType::i64 : DType::i32, dev, {E});
    if (!out.expert_load.empty()) expect_tensor(out.expert_load, "expert_load", DType::i64, dev, {E});
    const RouterAuxOutputs& aux = out.aux;
    if (!aux.router_logits.empty()) expect_tensor(aux.router_logits, "router_logits", DType::f32, dev, {T, E});
    if (!aux.router_probs.empty()) expect_tensor(aux.router_probs, "router_probs", DType::f32, dev, {T, E});
    if (!aux.losses.empty()) expect_tensor(aux.losses, "losses", DType::f32, dev, {2});

    // cuBLAS's handle and workspace are the router's: calls from several threads take turns, and
    // a call on another stream than the last waits for it (the workspace is reused).
    std::lock_guard<std::mutex> lock(mutex_);
    const cudaStream_t s = to_cuda(stream);
    call_order_.before(s);
    auto st = std::make_unique<CudaRouterState>();
    st->params = {T,
                  E,
                  k,
                  c_.score == ScoreFunction::sigmoid,
                  c_.renormalize,
                  float(c_.route_scale),
                  c_.aux_loss_coef,
                  c_.z_loss_coef,
                  c_.aux_loss_coef != 0 || !aux.losses.empty(),
                  c_.z_loss_coef != 0 || !aux.losses.empty()};
    st->x = x.data;
    st->w_router = w.data;
    st->stream = s;
    st->logits = std::make_unique<StreamScratch<float>>(T * E, s);
    st->scores = std::make_unique<StreamScratch<float>>(T * E, s);
    st->wrote_logits = !aux.router_logits.empty();
    st->wrote_probs = !aux.router_probs.empty();
    st->wrote_losses = !aux.losses.empty();
    // p: the caller's router_probs where asked for (the loss sums read it before the call returns
    // in stream order), else scratch where the balancing loss needs it.
    if (st->params.balance_on && !st->wrote_probs) st->p = std::make_unique<StreamScratch<float>>(T * E, s);
    st->lse = std::make_unique<StreamScratch<float>>(T, s);
    st->ids = std::make_unique<StreamScratch<int32_t>>(T * k, s);
    st->counts = std::make_unique<StreamScratch<int32_t>>(E, s);
    st->sums = std::make_unique<StreamScratch<double>>(E + 1, s);
    st->losses_dev = std::make_unique<StreamScratch<double>>(2, s);
    use_stream(s);
    const float one = 1.0f, zero = 0.0f;
    // Column-major logits^T [E, T] = W (as [H, E])^T x (as [H, T]).
    MOKA_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(E), int(T), int(H), &one, w.data, CUDA_R_16BF,
                                   int(H), x.data, CUDA_R_16BF, int(H), &zero, st->logits->data(), CUDA_R_32F, int(E),
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    MOKA_CUDA_CHECK(cudaMemsetAsync(st->counts->data(), 0, E * sizeof(int32_t), s));
    float* p = st->wrote_probs ? aux.router_probs.as<float>() : (st->p ? st->p->data() : nullptr);
    const auto warp_blocks = unsigned((T + kWarps - 1) / kWarps);
    route_tokens<<<warp_blocks, kThreads, 0, s>>>(st->params, st->logits->data(),
                                                  c_.use_selection_bias ? bias.as<float>() : nullptr,
                                                  st->scores->data(), p, st->lse->data(), aux.router_logits.as<float>(),
                                                  out.topk_ids.as<int32_t>(), st->ids->data(),
                                                  out.topk_weights.as<float>(), st->counts->data());
    MOKA_CUDA_CHECK_LAUNCH();
    if (st->params.balance_on || st->params.z_on) {  // off, both are 0 without their sums
      router_loss_sums<<<unsigned(E + 1), kThreads, 0, s>>>(st->params, p, st->lse->data(), st->sums->data());
      MOKA_CUDA_CHECK_LAUNCH();
    }
    router_losses<<<1, kThreads, 0, s>>>(st->params, st->counts->data(), st->sums->data(), st->losses_dev->data(),
                                         aux.losses.as<float>(), counts64 ? nullptr : out.expert_counts.as<int32_t>(),
                                         counts64 ? out.expert_counts.as<int64_t>() : nullptr,
                                         out.expert_load.as<int64_t>());
    MOKA_CUDA_CHECK_LAUNCH();
    call_order_.after(s);
    return st;
  }

  void backward(const RouterContext& saved, const TensorView& d_weights, const TensorView& d_x, const TensorView& d_w,
                Stream stream, bool add_to_d_x, const RouterAuxGradients& aux) override {
    const auto* st = dynamic_cast<const CudaRouterState*>(&saved);
    require(st != nullptr, ErrorCode::invalid_argument, "router backward got a context from another router");
    const Device dev = Device::cuda(device_);
    const int64_t T = st->params.tokens, H = c_.hidden, E = c_.num_experts, k = c_.top_k;
    expect_tensor(d_weights, "d_topk_weights", DType::f32, dev, {T, k});
    expect_tensor(d_x, "d_x", DType::bf16, dev, {T, H});
    expect_tensor(d_w, "d_w_router", DType::bf16, dev, {E, H});
    const AuxGradientPointers aux_grads = aux_gradients(*st, aux, dev);
    std::lock_guard<std::mutex> lock(mutex_);
    const cudaStream_t s = to_cuda(stream);
    call_order_.before(s);
    StreamScratch<float> ds(T * E, s);
    StreamScratch<bf16> d_logits(T * E, s);
    router_backward_tokens<<<unsigned((T + kWarps - 1) / kWarps), kThreads, 0, s>>>(st->params, st->logits->data(),
                                                                                    st->scores->data(), st->lse->data(),
                                                                                    st->ids->data(), st->counts->data(),
                                                                                    d_weights.as<float>(), aux_grads,
                                                                                    ds.data(), d_logits.data());
    MOKA_CUDA_CHECK_LAUNCH();
    use_stream(s);
    const float one = 1.0f, zero = 0.0f;
    // d_x^T [H, T] (+)= W^T (W as column-major [H, E]) d_logits^T (as [E, T]); adding in the
    // GEMM's fp32 epilogue rounds the sum to bf16 once.
    MOKA_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, int(H), int(T), int(E), &one, st->w_router,
                                   CUDA_R_16BF, int(H), d_logits.data(), CUDA_R_16BF, int(E), add_to_d_x ? &one : &zero,
                                   d_x.data, CUDA_R_16BF, int(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    // d_W^T [H, E] = x^T (as [H, T]) d_logits (as [E, T])^T.
    MOKA_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(E), int(T), &one, st->x, CUDA_R_16BF,
                                   int(H), d_logits.data(), CUDA_R_16BF, int(E), &zero, d_w.data, CUDA_R_16BF, int(H),
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    call_order_.after(s);
    // The scratch is freed at scope exit in stream order, after the kernels above.
  }

 private:
  // The caller's gradients of the RouterAuxOutputs, each checked against what the forward wrote.
  AuxGradientPointers aux_gradients(const CudaRouterState& st, const RouterAuxGradients& aux, const Device& dev) const {
    const int64_t T = st.params.tokens, E = c_.num_experts;
    auto given = [&](const TensorView& t, bool wrote, const char* name,
                     std::initializer_list<int64_t> shape) -> const float* {
      if (t.empty()) return nullptr;
      require(wrote, ErrorCode::invalid_argument,
              std::string("router backward got ") + name + " for an output its forward did not write");
      expect_tensor(t, name, DType::f32, dev, shape);
      return t.as<float>();
    };
    AuxGradientPointers g;
    g.d_logits = given(aux.d_router_logits, st.wrote_logits, "d_router_logits", {T, E});
    g.d_probs = given(aux.d_router_probs, st.wrote_probs, "d_router_probs", {T, E});
    g.d_losses = given(aux.d_losses, st.wrote_losses, "d_losses", {2});
    return g;
  }

  RouterConfig c_;
  int device_ = 0;
  cublasHandle_t cublas_ = nullptr;
  // cuBLAS's workspace, the router's own: a call captured in a CUDA graph then allocates nothing
  // (cublasSetStream drops a workspace set before it, so it is set again after each).
  static constexpr size_t kCublasWorkspace = size_t(32) << 20;  // what cuBLAS asks for on Hopper
  DeviceArray<unsigned char> workspace_;
  std::mutex mutex_;
  CallOrder call_order_;
  void use_stream(cudaStream_t s) {
    MOKA_CUBLAS_CHECK(cublasSetStream(cublas_, s));
    MOKA_CUBLAS_CHECK(cublasSetWorkspace(cublas_, workspace_.data(), kCublasWorkspace));
  }
};

}  // namespace

std::unique_ptr<Router> make_cuda_router(const RouterConfig& config, const LayerOptions&) {
  return std::make_unique<CudaRouter>(config);
}

}  // namespace moka::cuda
