// attention.cuh's fp32 reference kernels: a block per (sequence, head), a warp per query row, the
// seq x seq probabilities kept for backward. The path for head_dims the fused kernels do not take
// (--attention-kernel reference), and what they are tested against.
#include <cfloat>

#include "train/cuda/ops/attention.cuh"
#include "train/cuda/ops/attention_common.cuh"
#include "train/cuda/ops/kernel_helpers.cuh"

namespace moka::train::cuda {
namespace {

__device__ float dot(const float* a, const float* b, int64_t n) {
  float s = 0;
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}

// The rows of one head's K or V: row j at base + j * pitch.
struct HeadRows {
  const float* base;
  int64_t pitch;
  __device__ const float* row(int64_t j) const { return base + j * pitch; }
};

// Shared memory, when the launch gives it (`staged`): one head's K and V copied in (rows padded
// by one float, so lanes reading element c of different rows hit different banks: the dot
// products read one row per lane), and in the forward one row of scores per warp (the softmax
// and the weighted sum then read it there instead of from global memory). The same values either
// way, so the same bits. Unstaged, the kernels read the tensors where they are and use the
// global row.
__device__ int64_t head_tile(const AttnDims& a) { return a.seq * (a.hd + 1); }

__device__ HeadRows head_rows(const AttnDims& a, int64_t b, int64_t h, const float* t, float* tile) {
  if (!tile) return {t + a.at(b, h, 0), a.width()};
  const int64_t pitch = a.hd + 1;
  for (int64_t e = threadIdx.x; e < a.seq * a.hd; e += blockDim.x) {
    const int64_t j = e / a.hd, c = e % a.hd;
    tile[j * pitch + c] = t[a.at(b, h, j) + c];
  }
  return {tile, pitch};
}

// Block per (sequence, head); warp per query row. Lanes split the keys for scores and softmax,
// then the head dims for the weighted sum of values.
__global__ void attention_forward_kernel(AttnDims a, const float* q, const float* k, const float* v, float* probs,
                                         float* out, bool staged) {
  extern __shared__ float smem[];
  const int64_t bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads, S = a.seq;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const float scale = 1.0f / sqrtf(float(a.hd));
  const int64_t tile = head_tile(a);
  const HeadRows K = head_rows(a, b, h, k, staged ? smem : nullptr);
  const HeadRows V = head_rows(a, b, h, v, staged ? smem + tile : nullptr);
  __syncthreads();
  for (int64_t i = warp; i < S; i += kWarps) {
    float* P = probs + (bh * S + i) * S;
    float* row = staged ? smem + 2 * tile + warp * S : P;
    const float* qi = q + a.at(b, h, i);
    float mx = -FLT_MAX;
    for (int64_t j = lane; j <= i; j += 32) {
      const float s = dot(qi, K.row(j), a.hd) * scale;
      row[j] = s;
      mx = fmaxf(mx, s);
    }
    mx = warp_max(mx);
    float sum = 0;
    for (int64_t j = lane; j <= i; j += 32) sum += (row[j] = expf(row[j] - mx));
    sum = warp_sum(sum);
    for (int64_t j = lane; j < S; j += 32) {
      const float p = j <= i ? row[j] / sum : 0.0f;
      row[j] = p;
      P[j] = p;
    }
    __syncwarp();
    for (int64_t c = lane; c < a.hd; c += 32) {
      float o = 0;
      for (int64_t j = 0; j <= i; ++j) o += row[j] * V.row(j)[c];
      out[a.at(b, h, i) + c] = o;
    }
    __syncwarp();  // the next row overwrites `row`
  }
}

// Block per (sequence, head), K and V staged. Phase 1, warp per query row i:
// dS[i, j] = P (dP - <dP, P>) scale with dP = dO_i . v_j, and dq_i = sum_j dS[i, j] k_j. Phase 2,
// warp per key row j: dk_j = sum_i dS[i, j] q_i and dv_j = sum_i P[i, j] dO_i over i >= j, in
// order. (Staging Q and dO as well, with a score row per warp and transposed dS and P for phase
// 2, was slower on the H200: the larger shared memory halves the blocks per SM and the
// transposed stores scatter; docs/notes/benchmarks-log.md.)
__global__ void attention_backward_kernel(AttnDims a, const float* q, const float* k, const float* v,
                                          const float* probs, const float* d_out, float* d_scores, float* dq, float* dk,
                                          float* dv, bool staged) {
  extern __shared__ float smem[];
  const int64_t bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads, S = a.seq;
  const int lane = threadIdx.x & 31;
  const float scale = 1.0f / sqrtf(float(a.hd));
  const int64_t tile = head_tile(a);
  const HeadRows K = head_rows(a, b, h, k, staged ? smem : nullptr);
  const HeadRows V = head_rows(a, b, h, v, staged ? smem + tile : nullptr);
  __syncthreads();
  const float* P = probs + bh * S * S;
  float* dS = d_scores + bh * S * S;
  for (int64_t i = threadIdx.x / 32; i < S; i += kWarps) {
    const float* doi = d_out + a.at(b, h, i);
    float row_dot = 0;
    for (int64_t j = lane; j <= i; j += 32) {
      const float dp = dot(doi, V.row(j), a.hd);
      dS[i * S + j] = dp;
      row_dot += dp * P[i * S + j];
    }
    row_dot = warp_sum(row_dot);
    for (int64_t j = lane; j <= i; j += 32) dS[i * S + j] = P[i * S + j] * (dS[i * S + j] - row_dot) * scale;
    __syncwarp();
    for (int64_t c = lane; c < a.hd; c += 32) {
      float acc = 0;
      for (int64_t j = 0; j <= i; ++j) acc += dS[i * S + j] * K.row(j)[c];
      dq[a.at(b, h, i) + c] = acc;
    }
  }
  __syncthreads();
  for (int64_t j = threadIdx.x / 32; j < S; j += kWarps) {
    for (int64_t c = lane; c < a.hd; c += 32) {
      float acc_k = 0, acc_v = 0;
      for (int64_t i = j; i < S; ++i) {
        acc_k += dS[i * S + j] * q[a.at(b, h, i) + c];
        acc_v += P[i * S + j] * d_out[a.at(b, h, i) + c];
      }
      dk[a.at(b, h, j) + c] = acc_k;
      dv[a.at(b, h, j) + c] = acc_v;
    }
  }
}

}  // namespace

void attention_forward(const float* q, const float* k, const float* v, int64_t batch, int64_t seq, int64_t heads,
                       int64_t head_dim, float* probs, float* out, cudaStream_t s) {
  // K and V, and a row of scores per warp.
  const size_t smem = staging_bytes(attention_forward_kernel, 2 * seq * (head_dim + 1) + kWarps * seq);
  attention_forward_kernel<<<unsigned(batch * heads), kThreads, smem, s>>>({batch, seq, heads, head_dim}, q, k, v,
                                                                           probs, out, smem > 0);
}

void attention_backward(const float* q, const float* k, const float* v, const float* probs, const float* d_out,
                        int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, float* d_scores, float* dq,
                        float* dk, float* dv, cudaStream_t s) {
  const size_t smem = staging_bytes(attention_backward_kernel, 2 * seq * (head_dim + 1));  // K and V
  attention_backward_kernel<<<unsigned(batch * heads), kThreads, smem, s>>>({batch, seq, heads, head_dim}, q, k, v,
                                                                            probs, d_out, d_scores, dq, dk, dv,
                                                                            smem > 0);
}

}  // namespace moka::train::cuda
