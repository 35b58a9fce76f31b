// The CUDA engine's FFN block: moka's CUDA MoE layer (layer 0's dense FFN as a one-expert layer)
// and router, fed bf16 views of the weights' shadows and gradients and given the engine's stream,
// their saved contexts, and the router's aux-loss-free bias update on the device.
#include <cublas_v2.h>

#include <array>
#include <initializer_list>
#include <utility>

#include "cuda/common/check.hpp"
#include "train/cuda/engine_impl.hpp"
#include "train/cuda/ops/rmsnorm.cuh"
#include "train/cuda/ops/selection_bias.cuh"

namespace moka::train {

// The FFN's gate, up, down and shared gate, up, down as bf16 device views of the weights
// (`grads` false) or of the gradients; the shared ones empty without a shared expert.
std::array<TensorView, 6> CudaEngine::Impl::ffn_views(const Layer& L, bool grads) const {
  const int64_t H = c.d_model, E = L.experts, I = L.intermediate, Is = c.shared_intermediate;
  auto view = [&](const DeviceParam* p, std::initializer_list<int64_t> dims) {
    return p ? dev_view(grads ? p->grad16.data() : p->shadow.data(), DType::bf16, dims) : TensorView();
  };
  return {view(L.gate, {E, I, H}),      view(L.up, {E, I, H}),      view(L.down, {E, H, I}),
          view(L.shared_gate, {Is, H}), view(L.shared_up, {Is, H}), view(L.shared_down, {H, Is})};
}

MoeWeights CudaEngine::Impl::ffn_weights(const Layer& L) const {
  const auto v = ffn_views(L, false);
  return {v[0], v[1], v[2], v[3], v[4], v[5]};
}

TensorView CudaEngine::Impl::dev_view(void* p, DType t, std::initializer_list<int64_t> dims) const {
  return TensorView(p, t, dims, Device::cuda(device));
}

void CudaEngine::Impl::ffn_forward(Layer& L, ActivationStats* stats) {
  const int64_t H = c.d_model, k = L.top_k, E = L.experts;
  if (L.is_moe) {
    const RouterOutputs out{dev_view(L.topk_ids.data(), DType::i32, {N, k}),
                            dev_view(L.topk_weights.data(), DType::f32, {N, k}),
                            dev_view(L.counts.data(), DType::i32, {E})};
    L.router_ctx = L.router_op->forward(dev_view(L.ffn_x.data(), DType::bf16, {N, H}),
                                        dev_view(L.router->shadow.data(), DType::bf16, {E, H}),
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
void CudaEngine::Impl::ffn_backward(Layer& L) {
  mark(Stage::moe_backward);
  const int64_t H = c.d_model, k = L.top_k, E = L.experts;
  const auto d = ffn_views(L, true);
  const MoeGradients g{dev_view(dx16.data(), DType::bf16, {N, H}),
                       dev_view(d_topk_weights.data(), DType::f32, {N, k}),
                       d[0],
                       d[1],
                       d[2],
                       d[3],
                       d[4],
                       d[5]};
  L.ffn->consume_backward(std::move(L.ffn_ctx), dev_view(d_out16.data(), DType::bf16, {N, H}), ffn_weights(L), g,
                          Stream{stream});
  // The norm's input gradient: dx (+ the router's dx), summed in fp32 in that order as on the CPU.
  cuda::NormGrad dy;
  dy.b16[0] = dx16.data();
  if (L.is_moe) {
    L.router_op->backward(*L.router_ctx, dev_view(d_topk_weights.data(), DType::f32, {N, k}),
                          dev_view(dx_router16.data(), DType::bf16, {N, H}),
                          dev_view(L.router->grad16.data(), DType::bf16, {E, H}), Stream{stream});
    dy.b16[1] = dx_router16.data();
  }
  mark(Stage::norms_backward);
  cuda::rmsnorm_backward(L.ffn_in.data(), L.ffn_norm->value.data(), L.ffn_inv_rms.data(), dy, N, H, true, d_res.data(),
                         nullptr, L.ffn_norm->grad.data(), gain_partials.data(), stream);
  MOKA_CUDA_CHECK_LAUNCH();
}

// The routers' and layers' saved contexts are freed in stream order: inside a captured step,
// their scratch is allocated and freed within the graph.
void CudaEngine::Impl::release_contexts() {
  for (auto& L : layers) {
    L.router_ctx.reset();
    L.ffn_ctx.reset();
  }
}

void CudaEngine::Impl::router_bias_step() {
  mark(Stage::router_bias);
  if (config.bias_update_rate <= 0) return;
  for (auto& L : layers)
    if (L.is_moe)
      cuda::update_selection_bias(L.counts.data(), L.experts, config.bias_update_rate, L.bias64.data(), L.bias.data(),
                                  stream);
  MOKA_CUDA_CHECK_LAUNCH();
}

}  // namespace moka::train
