// The CUDA engine's attention block: the dense projections (cuBLAS, TF32 or bf16 operands; the
// LM head and the router statistics use gemm and linear too) and the attention between them,
// fused or the reference kernels (TrainConfig::fused_attention), forward and backward.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "cuda/common/check.hpp"
#include "train/cuda/engine_impl.hpp"
#include "train/cuda/ops/attention.cuh"
#include "train/cuda/ops/rmsnorm.cuh"
#include "train/cuda/ops/to_bf16.cuh"

namespace moka::train {

// cuBLAS, column-major views of row-major matrices; operands f32 on TF32 tensor cores, or
// bf16 (`bf16_operands`) on bf16 tensor cores; C f32, fp32 accumulation either way.
void CudaEngine::Impl::gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha,
                            const void* A, int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc,
                            bool bf16_operands) {
  const cudaDataType operand = bf16_operands ? CUDA_R_16BF : CUDA_R_32F;
  MOKA_CUBLAS_CHECK(cublasGemmEx(cublas, ta, tb, int(m), int(n), int(k), &alpha, A, operand, int(lda), B, operand,
                                 int(ldb), &beta, C, CUDA_R_32F, int(ldc),
                                 bf16_operands ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32,
                                 CUBLAS_GEMM_DEFAULT));
}

// With bf16 matmuls: the bf16 copy of an f32 activation or gradient of n elements, in one of the
// two operand buffers.
const bf16* CudaEngine::Impl::matmul_operand(const float* x, int64_t n, int buffer) {
  cuda::to_bf16(x, n, matmul16[buffer].data(), stream);
  MOKA_CUDA_CHECK_LAUNCH();
  return matmul16[buffer].data();
}

// y [rows, out] = fwd * x W^T;  W: [out, in].
void CudaEngine::Impl::linear(const float* x, const DeviceParam& w, float* y) {
  const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
  if (config.bf16_matmuls)
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, N, in, w.fwd(), w.shadow.data(), in, matmul_operand(x, N * in, 0), in, 0.0f, y,
         out, true);
  else gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, N, in, w.fwd(), w.value.data(), in, x, in, 0.0f, y, out);
}

// dx = fwd * dy W (added to dx when `accumulate`); dW = fwd * dy^T x (overwritten).
void CudaEngine::Impl::linear_backward(const float* x, DeviceParam& w, const float* dy, float* dx, bool accumulate) {
  const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
  const bool b16 = config.bf16_matmuls;
  const void* W = b16 ? static_cast<const void*>(w.shadow.data()) : w.value.data();
  const void* X = b16 ? static_cast<const void*>(matmul_operand(x, N * in, 0)) : x;
  const void* dY = b16 ? static_cast<const void*>(matmul_operand(dy, N * out, 1)) : dy;
  gemm(CUBLAS_OP_N, CUBLAS_OP_N, in, N, out, w.fwd(), W, in, dY, out, accumulate ? 1.0f : 0.0f, dx, in, b16);
  gemm(CUBLAS_OP_N, CUBLAS_OP_T, in, out, N, w.fwd(), X, in, dY, out, 0.0f, w.grad.data(), in, b16);
}

void CudaEngine::Impl::attention_forward(Layer& L) {
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
    cuda::flash_attention_forward(L.q.data(), L.k.data(), L.v.data(), config.batch, config.seq, c.num_heads, c.head_dim,
                                  L.lse.data(), L.context.data(), stream);
  else
    cuda::attention_forward(L.q.data(), L.k.data(), L.v.data(), config.batch, config.seq, c.num_heads, c.head_dim,
                            L.probs.data(), L.context.data(), stream);
  MOKA_CUDA_CHECK_LAUNCH();
  linear(L.context.data(), *L.attn_out, branch.data());
}

// d_res holds the gradient of the attention branch output; adds the gradient of attn_x's
// RMSNorm input into d_res (and its bf16 copy into d_out16, the next FFN backward's input).
void CudaEngine::Impl::attention_backward(Layer& L) {
  mark(Stage::attention_backward);
  linear_backward(L.context.data(), *L.attn_out, d_res.data(), d_context.data(), false);
  if (fused_attention)
    cuda::flash_attention_backward(L.q.data(), L.k.data(), L.v.data(), L.context.data(), L.lse.data(), d_context.data(),
                                   config.batch, config.seq, c.num_heads, c.head_dim, row_dot.data(), dq.data(),
                                   dk.data(), dv.data(), stream);
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

}  // namespace moka::train
