#include <mma.h>

#include <cfloat>
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/common/check.hpp"
#include "train/cuda_kernels.cuh"

namespace moka::train::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kAdamWPerThread = 4;  // elements per AdamW thread: one 16-byte access per f32 array
constexpr int kWarps = kThreads / 32;

unsigned blocks_for(int64_t n, int per_block = kThreads) { return unsigned((n + per_block - 1) / per_block); }

// Warp butterflies: every lane ends with the same value, combined in a fixed pattern.
__device__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block sum in a fixed order (lanes, then warps in order); every thread gets the result.
__device__ double block_sum(double v) {
  __shared__ double part[kWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  double r = 0;
  for (int w = 0; w < kWarps; ++w) r += part[w];
  __syncthreads();
  return r;
}

__global__ void embed_forward_kernel(const int32_t* tokens, const float* table, float scale, int64_t rows, int64_t d,
                                     float* h) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * d) return;
  h[i] = scale * table[int64_t(tokens[i / d]) * d + i % d];
}

__global__ void embed_backward_kernel(const int32_t* offsets, const int32_t* positions, const float* d_h, float scale,
                                      int64_t vocab, int64_t d, float* grad) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vocab * d) return;
  const int64_t tok = i / d, c = i % d;
  float acc = 0;
  for (int32_t p = offsets[tok]; p < offsets[tok + 1]; ++p) acc += scale * d_h[int64_t(positions[p]) * d + c];
  grad[i] = acc;
}

// One warp per row. Each lane reads back only the elements it wrote, so `sum` may alias x.
__global__ void residual_rmsnorm_kernel(const float* x, ResidualDelta delta, float* sum, float* saved,
                                        const float* gain, int64_t rows, int64_t d, float eps, float* y, bf16* yb,
                                        float* inv_rms) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int64_t row = r * d;
  auto at = [&](int64_t i) {
    float v = x[row + i];
    if (delta.f32) v += delta.f32[row + i];
    if (delta.b16) v += __bfloat162float(delta.b16[row + i]);
    return v;
  };
  float ss = 0;
  for (int64_t i = lane; i < d; i += 32) {
    const float v = at(i);
    if (sum) sum[row + i] = v;
    if (saved) saved[row + i] = v;
    ss += v * v;
  }
  const float* s = sum ? sum : x;
  const float inv = 1.0f / sqrtf(warp_sum(ss) / float(d) + eps);
  if (lane == 0) inv_rms[r] = inv;
  for (int64_t i = lane; i < d; i += 32) {
    const float v = (sum ? s[row + i] : at(i)) * inv * gain[i];
    if (y) y[row + i] = v;
    if (yb) yb[row + i] = __float2bfloat16(v);
  }
}

__device__ float norm_grad_at(const NormGrad& g, int64_t i) {
  if (g.f32) return g.f32[i];
  float v = __bfloat162float(g.b16[0][i]);
  if (g.b16[1]) v += __bfloat162float(g.b16[1][i]);
  return v;
}

__global__ void rmsnorm_backward_rows(const float* x, const float* gain, const float* inv_rms, NormGrad dy,
                                      int64_t rows, int64_t d, bool accumulate, float* dx, bf16* dx16) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float inv = inv_rms[r];
  const float* xr = x + r * d;
  float dot = 0;
  for (int64_t i = lane; i < d; i += 32) dot += gain[i] * norm_grad_at(dy, r * d + i) * xr[i] * inv;
  const float mean = warp_sum(dot) / float(d);
  for (int64_t i = lane; i < d; i += 32) {
    const float v = inv * (gain[i] * norm_grad_at(dy, r * d + i) - xr[i] * inv * mean);
    const float out = accumulate ? dx[r * d + i] + v : v;
    dx[r * d + i] = out;
    if (dx16) dx16[r * d + i] = __float2bfloat16(out);
  }
}

// Pass 1 of the gain gradient: thread (column, chunk) sums dy*xhat over the chunk's rows in
// order; pass 2 sums the chunks in order. The chunks give the GPU d * kNormGainChunks threads:
// d threads alone, each a chain of `rows` dependent adds, leave it nearly idle.
__global__ void rmsnorm_gain_partials(const float* x, const float* inv_rms, NormGrad dy, int64_t rows, int64_t d,
                                      float* partials) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d) return;
  const int64_t per_chunk = (rows + kNormGainChunks - 1) / kNormGainChunks;
  const int64_t first = blockIdx.y * per_chunk, last = min(rows, first + per_chunk);
  float acc = 0;
  for (int64_t r = first; r < last; ++r) acc += norm_grad_at(dy, r * d + i) * x[r * d + i] * inv_rms[r];
  partials[blockIdx.y * d + i] = acc;
}

__global__ void rmsnorm_gain_sum(const float* partials, int64_t d, float* d_gain) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d) return;
  float acc = 0;
  for (int c = 0; c < kNormGainChunks; ++c) acc += partials[c * d + i];
  d_gain[i] = acc;
}

struct AttnDims {
  int64_t batch, seq, heads, hd;
  __device__ int64_t width() const { return heads * hd; }
  // Row i of sequence b, head h.
  __device__ int64_t at(int64_t b, int64_t h, int64_t i) const { return (b * seq + i) * width() + h * hd; }
};

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

// --- Fused (FlashAttention-style) attention on tensor cores: the same function as the kernels
// above without the seq x seq probabilities in global memory. The forward keeps, per query row,
// a running max and sum over key tiles (online softmax) and saves only the output and the row's
// logsumexp; the backward recomputes the probabilities tile by tile from it. Products run as
// TF32 WMMA (mma.sync) with fp32 accumulation, the softmax in fp32: the precision of the
// trainer's cuBLAS TF32 matmuls. Tiles: kFlashTile query rows by kFlashTile key rows per block
// iteration, 16 rows per warp; head_dim is zero-padded in shared memory to a multiple of 16
// (kFlashMaxHeadDim at most). Every output element has one writer and a fixed order of
// accumulation (dK and dV in key-tile blocks, dQ in query-tile blocks, each over the other
// tiles in order): no atomics, the same bits on every run.
constexpr int kFlashTile = 64;
constexpr int kFlashWarps = kFlashTile / 16;
constexpr int kFlashThreads = 32 * kFlashWarps;
constexpr int kFlashPad = 4;                       // floats per shared row (WMMA needs ld % 4 == 0)
constexpr int kScoreLd = kFlashTile + kFlashPad;   // a warp's 16 x kFlashTile score rows
constexpr int kWarpScores = 16 * kScoreLd;

namespace wmma = nvcuda::wmma;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// acc[f] += A (16 x K, row-major, lda) times columns [16f, 16f+16) of B (K x 16*F), where B(k, n)
// is b[k * ldb + n] (BLayout row_major) or b[n * ldb + k] (col_major: B is a row-major matrix
// transposed). Operands already rounded to TF32 in shared memory.
template <int F, int K, typename BLayout>
__device__ void warp_mma(Accumulator (&acc)[F], const float* a, int lda, const float* b, int ldb) {
  constexpr bool b_rows = std::is_same_v<BLayout, wmma::row_major>;
#pragma unroll
  for (int kk = 0; kk < K; kk += 8) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + kk, lda);
#pragma unroll
    for (int f = 0; f < F; ++f) {
      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, BLayout> fb;
      wmma::load_matrix_sync(fb, b_rows ? b + kk * ldb + 16 * f : b + 16 * f * ldb + kk, ldb);
      wmma::mma_sync(acc[f], fa, fb, acc[f]);
    }
  }
}

template <int F>
__device__ void zero(Accumulator (&acc)[F]) {
#pragma unroll
  for (int f = 0; f < F; ++f) wmma::fill_fragment(acc[f], 0.0f);
}

template <int F>
__device__ void store(const Accumulator (&acc)[F], float* to, int ld) {
#pragma unroll
  for (int f = 0; f < F; ++f) wmma::store_matrix_sync(to + 16 * f, acc[f], ld, wmma::mem_row_major);
}

// Rows [r0, r0 + kFlashTile) of head (b, h) of t into a shared tile (row pitch HD + kFlashPad),
// rounded to TF32; rows past seq and columns past head_dim are zeros. `Width` floats per load
// (4 where head_dim and t allow 16-byte loads), each thread's loads issued kLoadsInFlight at a
// time before their values are stored: a tile costs a few memory latencies, not one per element
// (more in flight would cost registers the kernels' occupancy needs).
constexpr int kLoadsInFlight = 4;

__device__ float component(float v, int) { return v; }
__device__ float component(const float4& v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }

template <int HD, int Width>
__device__ void load_tile_by(const AttnDims& a, int64_t b, int64_t h, const float* t, int64_t r0, float* tile) {
  using Vec = std::conditional_t<Width == 4, float4, float>;
  constexpr int per_row = HD / Width, per_thread = kFlashTile * per_row / kFlashThreads;
  constexpr int in_flight = per_thread < kLoadsInFlight ? per_thread : kLoadsInFlight;
  static_assert(kFlashTile * per_row % kFlashThreads == 0 && per_thread % in_flight == 0);
#pragma unroll 1
  for (int u0 = 0; u0 < per_thread; u0 += in_flight) {
    Vec x[in_flight];
#pragma unroll
    for (int u = 0; u < in_flight; ++u) {
      const int e = threadIdx.x + (u0 + u) * kFlashThreads, r = e / per_row, c = Width * (e % per_row);
      x[u] = r0 + r < a.seq && c < a.hd ? *reinterpret_cast<const Vec*>(t + a.at(b, h, r0 + r) + c) : Vec{};
    }
#pragma unroll
    for (int u = 0; u < in_flight; ++u) {
      const int e = threadIdx.x + (u0 + u) * kFlashThreads, r = e / per_row, c = Width * (e % per_row);
#pragma unroll
      for (int w = 0; w < Width; ++w) tile[r * (HD + kFlashPad) + c + w] = wmma::__float_to_tf32(component(x[u], w));
    }
  }
}

template <int HD>
__device__ void load_tile(const AttnDims& a, int64_t b, int64_t h, const float* t, int64_t r0, float* tile) {
  if (a.hd % 4 == 0 && reinterpret_cast<uintptr_t>(t) % 16 == 0)
    load_tile_by<HD, 4>(a, b, h, t, r0, tile);
  else
    load_tile_by<HD, 1>(a, b, h, t, r0, tile);
}

// src[bh * seq + q0 + r] for the tile's rows r (0 past seq): lse or row_dot of a query tile.
__device__ void load_row_values(const AttnDims& a, const float* src, int64_t bh, int64_t q0, float* to) {
  for (int r = threadIdx.x; r < kFlashTile; r += kFlashThreads) to[r] = q0 + r < a.seq ? src[bh * a.seq + q0 + r] : 0.0f;
}

// Rows [0, 16) of a warp's shared tile (pitch ld) to rows r0.. of head (b, h) of t, below seq.
__device__ void store_warp_rows(const AttnDims& a, int64_t b, int64_t h, const float* rows, int ld, int64_t r0,
                                float* t) {
  const int lane = threadIdx.x & 31;
  for (int r = 0; r < 16 && r0 + r < a.seq; ++r)
    for (int64_t c = lane; c < a.hd; c += 32) t[a.at(b, h, r0 + r) + c] = rows[r * ld + c];
}

template <int HD>
constexpr size_t flash_forward_floats() { return 4 * kFlashTile * (HD + kFlashPad) + kFlashWarps * kWarpScores; }

// The blocks an SM holds by shared memory (228 KB, 1 KB of it reserved per block; at most 4):
// the kernels' register budget is set to match (__launch_bounds__), so that registers do not
// cut the occupancy below what shared memory allows.
constexpr int flash_blocks_per_sm(size_t floats) {
  const size_t blocks = (228 * 1024) / (floats * sizeof(float) + 1024);
  return blocks < 1 ? 1 : blocks > 4 ? 4 : int(blocks);
}

// Block (b*heads + h, query tile); warp w owns query rows [16w, 16w + 16) of the tile, the running
// max and sum of row r in lanes r and r + 16 (read by the others through shuffles), its output
// rows in shared memory (rescaled by the softmax correction before each key tile's P V is added).
template <int HD>
__global__ void __launch_bounds__(kFlashThreads, flash_blocks_per_sm(flash_forward_floats<HD>()))
    flash_forward_kernel(AttnDims a, const float* q, const float* k, const float* v, float* lse, float* out) {
  constexpr int ld = HD + kFlashPad, F = HD / 16;
  extern __shared__ __align__(128) float smem[];
  float *Qs = smem, *Ks = Qs + kFlashTile * ld, *Vs = Ks + kFlashTile * ld, *Os = Vs + kFlashTile * ld;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  float* Ow = Os + warp * 16 * ld;
  float* Sw = Os + kFlashTile * ld + warp * kWarpScores;
  const int64_t bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads;
  const int64_t q0 = int64_t(blockIdx.y) * kFlashTile, row0 = q0 + warp * 16;
  const float scale = 1.0f / sqrtf(float(a.hd));
  load_tile<HD>(a, b, h, q, q0, Qs);
  for (int e = threadIdx.x; e < kFlashTile * ld; e += blockDim.x) Os[e] = 0.0f;
  float my_max = -INFINITY, my_sum = 0.0f;  // of row lane % 16
  // Key tiles up to the tile's last query row (causal). Key 0 is in the first, so every row's
  // max is finite from then on (rows past seq included: their keys are zeros).
  const int64_t key_end = min(a.seq, q0 + kFlashTile);
  for (int64_t k0 = 0; k0 < key_end; k0 += kFlashTile) {
    __syncthreads();  // the previous tile's K and V are read
    load_tile<HD>(a, b, h, k, k0, Ks);
    load_tile<HD>(a, b, h, v, k0, Vs);
    __syncthreads();
    Accumulator s[kFlashTile / 16];
    zero(s);
    warp_mma<kFlashTile / 16, HD, wmma::col_major>(s, Qs + warp * 16 * ld, ld, Ks, ld);  // Q K^T
    store(s, Sw, kScoreLd);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float x[kFlashTile / 32];
      float tile_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kFlashTile / 32; ++u) {
        const int64_t j = k0 + lane + 32 * u;
        x[u] = j <= row0 + r && j < a.seq ? Sw[r * kScoreLd + lane + 32 * u] * scale : -INFINITY;
        tile_max = fmaxf(tile_max, x[u]);
      }
      const float old_max = __shfl_sync(0xffffffffu, my_max, r), old_sum = __shfl_sync(0xffffffffu, my_sum, r);
      const float new_max = fmaxf(old_max, warp_max(tile_max));
      const float correction = expf(old_max - new_max);
      float sum = 0;
#pragma unroll
      for (int u = 0; u < kFlashTile / 32; ++u) {
        const float p = expf(x[u] - new_max);
        sum += p;
        Sw[r * kScoreLd + lane + 32 * u] = wmma::__float_to_tf32(p);
      }
      const float new_sum = old_sum * correction + warp_sum(sum);
      if ((lane & 15) == r) my_max = new_max, my_sum = new_sum;
      for (int c = lane; c < HD; c += 32) Ow[r * ld + c] *= correction;
    }
    __syncwarp();
    Accumulator o[F];
#pragma unroll
    for (int f = 0; f < F; ++f) wmma::load_matrix_sync(o[f], Ow + 16 * f, ld, wmma::mem_row_major);
    warp_mma<F, kFlashTile, wmma::row_major>(o, Sw, kScoreLd, Vs, ld);  // += P V
    store(o, Ow, ld);
    __syncwarp();
  }
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const float row_sum = __shfl_sync(0xffffffffu, my_sum, r);
    for (int c = lane; c < HD; c += 32) Ow[r * ld + c] /= row_sum;
  }
  if (lane < 16 && row0 + lane < a.seq) lse[bh * a.seq + row0 + lane] = my_max + logf(my_sum);
  __syncwarp();
  store_warp_rows(a, b, h, Ow, ld, row0, out);
}

// The probabilities and score gradients of one warp's 16 x kFlashTile block, in place in shared
// memory: P = exp(scale S - lse_i) where key j <= query i < seq (else 0), rounded to TF32 into
// `scores`, and dS = P (dP - rowdot_i) scale into `d_probs`. `transposed`: the block's rows are
// keys (index j) and its columns queries (index i); else rows are queries.
__device__ void probabilities_and_gradients(const AttnDims& a, int64_t row0, int64_t col0, bool transposed,
                                            const float* lse, const float* row_dot, float* scores, float* d_probs) {
  const float scale = 1.0f / sqrtf(float(a.hd));
  for (int e = threadIdx.x & 31; e < 16 * kFlashTile; e += 32) {
    const int r = e / kFlashTile, c = e % kFlashTile, at = r * kScoreLd + c;
    const int64_t i = transposed ? col0 + c : row0 + r, j = transposed ? row0 + r : col0 + c;
    const int qi = transposed ? c : r;  // lse and row_dot: indexed by the query's place in its tile
    const float p = j <= i && i < a.seq ? expf(scores[at] * scale - lse[qi]) : 0.0f;
    scores[at] = wmma::__float_to_tf32(p);
    d_probs[at] = wmma::__float_to_tf32(p * (d_probs[at] - row_dot[qi]) * scale);
  }
}

// The backward kernels' shared memory. Each block owns one tile of rows (queries for dQ, keys for
// dK and dV) with two tensors of them (Q and dO, or K and V), and walks the tiles of the other
// rows with their two tensors (K and V, or Q and dO); each warp's 16 x kFlashTile blocks of
// scores and of their gradients, transposed for the key-tile blocks; lse and row_dot of the
// current query tile's rows.
template <int HD>
struct BackwardShared {
  static constexpr int ld = HD + kFlashPad;
  float *own[2], *other[2], *scores, *d_probs, *lse, *row_dot;
  __device__ BackwardShared(float* smem, int warp) {
    own[0] = smem, own[1] = own[0] + kFlashTile * ld, other[0] = own[1] + kFlashTile * ld;
    other[1] = other[0] + kFlashTile * ld;
    float* blocks = other[1] + kFlashTile * ld;
    scores = blocks + warp * kWarpScores, d_probs = scores + kFlashWarps * kWarpScores;
    lse = blocks + 2 * kFlashWarps * kWarpScores, row_dot = lse + kFlashTile;
  }
  // The warp's blocks against the current other tile: scores = own[0] other[0]^T and
  // d_probs = own[1] other[1]^T over the warp's 16 own rows (S = Q K^T and dP = dO V^T, or
  // their transposes), then probabilities_and_gradients.
  __device__ void score_blocks(const AttnDims& a, int warp, int64_t row0, int64_t col0, bool transposed) {
    Accumulator s[kFlashTile / 16];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      zero(s);
      warp_mma<kFlashTile / 16, HD, wmma::col_major>(s, own[t] + warp * 16 * ld, ld, other[t], ld);
      store(s, t == 0 ? scores : d_probs, kScoreLd);
    }
    __syncwarp();
    const int qi = transposed ? 0 : warp * 16;  // the warp's first query row in the tile
    probabilities_and_gradients(a, row0, col0, transposed, lse + qi, row_dot + qi, scores, d_probs);
    __syncwarp();
  }
};

template <int HD>
constexpr size_t flash_backward_floats() {
  return 4 * kFlashTile * (HD + kFlashPad) + 2 * kFlashWarps * kWarpScores + 2 * kFlashTile;
}

// Block (b*heads + h, query tile), run before the dK/dV kernel: row_dot_i = dO_i . O_i for the
// tile's rows (written for that kernel), then dQ_i = sum over key tiles of dS K.
template <int HD>
__global__ void __launch_bounds__(kFlashThreads, flash_blocks_per_sm(flash_backward_floats<HD>()))
    flash_backward_dq_kernel(AttnDims a, const float* q, const float* k, const float* v, const float* out,
                             const float* lse, const float* d_out, float* row_dot, float* dq) {
  extern __shared__ __align__(128) float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  BackwardShared<HD> sh(smem, warp);
  const int64_t bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads;
  const int64_t q0 = int64_t(blockIdx.y) * kFlashTile, row0 = q0 + warp * 16;
  load_tile<HD>(a, b, h, q, q0, sh.own[0]);
  load_tile<HD>(a, b, h, d_out, q0, sh.own[1]);
  load_tile<HD>(a, b, h, out, q0, sh.other[0]);  // O, until the first key tile replaces it
  load_row_values(a, lse, bh, q0, sh.lse);
  __syncthreads();
  // row_dot from the TF32-rounded dO that dP is computed from, so that dP - row_dot cancels where
  // it should (exactly, up to the order of summation, at seq 1, where O is V).
  const int at = warp * 16 * sh.ld;
  for (int r = 0; r < 16; ++r) {
    float d = 0;
    for (int c = lane; c < HD; c += 32) d += sh.own[1][at + r * sh.ld + c] * sh.other[0][at + r * sh.ld + c];
    d = warp_sum(d);
    if (lane == 0) {
      sh.row_dot[warp * 16 + r] = d;
      if (row0 + r < a.seq) row_dot[bh * a.seq + row0 + r] = d;
    }
  }
  Accumulator acc[HD / 16];
  zero(acc);
  const int64_t key_end = min(a.seq, q0 + kFlashTile);
  for (int64_t k0 = 0; k0 < key_end; k0 += kFlashTile) {
    __syncthreads();
    load_tile<HD>(a, b, h, k, k0, sh.other[0]);
    load_tile<HD>(a, b, h, v, k0, sh.other[1]);
    __syncthreads();
    sh.score_blocks(a, warp, row0, k0, false);
    warp_mma<HD / 16, kFlashTile, wmma::row_major>(acc, sh.d_probs, kScoreLd, sh.other[0], sh.ld);  // dQ += dS K
  }
  float* dQw = sh.own[0] + warp * 16 * sh.ld;  // the warp's own Q rows, read by no other warp
  store(acc, dQw, sh.ld);
  __syncwarp();
  store_warp_rows(a, b, h, dQw, sh.ld, row0, dq);
}

// Block (b*heads + h, key tile); warp w owns key rows [16w, 16w + 16) and works on transposed
// blocks (keys by queries): dV_j = sum_i P_ij dO_i and dK_j = sum_i dS_ij Q_i over the query
// tiles from the key tile's own on (causal), in order.
template <int HD>
__global__ void __launch_bounds__(kFlashThreads, flash_blocks_per_sm(flash_backward_floats<HD>()))
    flash_backward_dkv_kernel(AttnDims a, const float* q, const float* k, const float* v, const float* lse,
                              const float* row_dot, const float* d_out, float* dk, float* dv) {
  extern __shared__ __align__(128) float smem[];
  const int warp = threadIdx.x / 32;
  BackwardShared<HD> sh(smem, warp);
  const int64_t bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads;
  const int64_t k0 = int64_t(blockIdx.y) * kFlashTile, row0 = k0 + warp * 16;
  load_tile<HD>(a, b, h, k, k0, sh.own[0]);
  load_tile<HD>(a, b, h, v, k0, sh.own[1]);
  Accumulator acc_k[HD / 16], acc_v[HD / 16];
  zero(acc_k);
  zero(acc_v);
  for (int64_t q0 = k0; q0 < a.seq; q0 += kFlashTile) {
    __syncthreads();
    load_tile<HD>(a, b, h, q, q0, sh.other[0]);
    load_tile<HD>(a, b, h, d_out, q0, sh.other[1]);
    load_row_values(a, lse, bh, q0, sh.lse);
    load_row_values(a, row_dot, bh, q0, sh.row_dot);
    __syncthreads();
    sh.score_blocks(a, warp, row0, q0, true);
    warp_mma<HD / 16, kFlashTile, wmma::row_major>(acc_v, sh.scores, kScoreLd, sh.other[1], sh.ld);   // dV += P^T dO
    warp_mma<HD / 16, kFlashTile, wmma::row_major>(acc_k, sh.d_probs, kScoreLd, sh.other[0], sh.ld);  // dK += dS^T Q
  }
  float *dKw = sh.own[0] + warp * 16 * sh.ld, *dVw = sh.own[1] + warp * 16 * sh.ld;  // the warp's own rows
  store(acc_k, dKw, sh.ld);
  store(acc_v, dVw, sh.ld);
  __syncwarp();
  store_warp_rows(a, b, h, dKw, sh.ld, row0, dk);
  store_warp_rows(a, b, h, dVw, sh.ld, row0, dv);
}

__global__ void cross_entropy_kernel(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                                     float* row_loss, float* d_logits) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float* l = logits + r * vocab;
  float mx = -FLT_MAX;
  for (int64_t v = lane; v < vocab; v += 32) mx = fmaxf(mx, l[v]);
  mx = warp_max(mx);
  float sum = 0;
  for (int64_t v = lane; v < vocab; v += 32) sum += expf(l[v] - mx);
  const float lse = mx + logf(warp_sum(sum));
  const int32_t t = targets[r];
  if (lane == 0) row_loss[r] = lse - l[t];
  for (int64_t v = lane; v < vocab; v += 32)
    d_logits[r * vocab + v] = (expf(l[v] - lse) - (v == t ? 1.0f : 0.0f)) / float(rows);
}

// Partial `part` of kReduceBlocks over x: a grid-stride loop as if it were block `part` of a
// kReduceBlocks-block launch.
__device__ void reduce_part(ReduceOp op, const void* x, bool is_bf16, int64_t n, int part, double* out) {
  double acc = 0;
  for (int64_t i = int64_t(part) * blockDim.x + threadIdx.x; i < n; i += int64_t(kReduceBlocks) * blockDim.x) {
    const double v = is_bf16 ? double(__bfloat162float(static_cast<const bf16*>(x)[i])) : double(static_cast<const float*>(x)[i]);
    acc += op == ReduceOp::sum ? v : op == ReduceOp::abs ? fabs(v) : v * v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

__global__ void reduce_partials_kernel(ReduceOp op, const void* x, bool is_bf16, int64_t n, double* partials) {
  reduce_part(op, x, is_bf16, n, blockIdx.x, partials + blockIdx.x);
}

// Block b: partial b % kReduceBlocks of slot b / kReduceBlocks.
__global__ void grad_square_partials_kernel(const TensorSlot* slots, double* partials) {
  const TensorSlot& t = slots[blockIdx.x / kReduceBlocks];
  reduce_part(ReduceOp::square, t.grad, t.grad_bf16, t.n, blockIdx.x % kReduceBlocks, partials + blockIdx.x);
}

__global__ void reduce_finish_kernel(const double* partials, int64_t count, double scale, double* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = scale * acc;
}

__global__ void to_bf16_kernel(const float* src, int64_t n, bf16* dst) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __float2bfloat16(src[i]);
}

// AdamW (optimizer.cpp's arithmetic) of one element, then its EMA and bf16 copy where the slot
// has them.
struct AdamWStep {
  float clip, step_size, decay, bias_correction1, bias_correction2;
};
__device__ __forceinline__ void adamw_element(const AdamWHyper& a, const AdamWStep& s, float raw, float& m, float& v,
                                              float& p, float* ema) {
  const float g = s.clip * raw;
  m = a.beta1 * m + (1 - a.beta1) * g;
  v = a.beta2 * v + (1 - a.beta2) * g * g;
  const float m_hat = m / s.bias_correction1, v_hat = v / s.bias_correction2;
  p = p * s.decay - s.step_size * m_hat / (sqrtf(v_hat) + a.eps);
  if (ema) *ema = a.ema_decay * *ema + (1 - a.ema_decay) * p;
}

__device__ __forceinline__ float grad_at(const TensorSlot& t, int64_t i) {
  return t.grad_bf16 ? __bfloat162float(static_cast<const bf16*>(t.grad)[i]) : static_cast<const float*>(t.grad)[i];
}

// Whether every array of the slot can be read kAdamWPerThread elements at a time (16 bytes of
// f32, 8 of bf16).
__device__ bool adamw_vectorizable(const TensorSlot& t) {
  const auto f32 = reinterpret_cast<uintptr_t>(t.value) | reinterpret_cast<uintptr_t>(t.m) |
                   reinterpret_cast<uintptr_t>(t.v) | reinterpret_cast<uintptr_t>(t.ema);
  const auto narrow = reinterpret_cast<uintptr_t>(t.shadow) | (t.grad_bf16 ? reinterpret_cast<uintptr_t>(t.grad) : 0);
  const auto wide = t.grad_bf16 ? 0 : reinterpret_cast<uintptr_t>(t.grad);
  return (f32 | wide) % 16 == 0 && narrow % 8 == 0;
}

// Block b updates kThreads x kAdamWPerThread elements of the slot whose blocks hold b (a binary
// search over the slots' first blocks); each thread takes kAdamWPerThread consecutive elements
// in 16-byte loads and stores where the slot's arrays allow, one by one otherwise: the same
// arithmetic per element either way, so the same bits.
__global__ void adamw_kernel(AdamWHyper a, const StepScalars* step, const double* grad_sum_squares,
                             const TensorSlot* slots, int count) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (slots[mid].first_block <= int64_t(blockIdx.x)) lo = mid; else hi = mid - 1;
  }
  const TensorSlot& t = slots[lo];
  const int64_t first = ((int64_t(blockIdx.x) - t.first_block) * blockDim.x + threadIdx.x) * kAdamWPerThread;
  if (first >= t.n) return;
  const double lr = step->lr;
  const double norm = sqrt(*grad_sum_squares);
  const AdamWStep s{float(a.clip_norm > 0 && norm > a.clip_norm ? a.clip_norm / norm : 1.0),
                    float(lr * t.lr_multiplier), float(1.0 - lr * a.weight_decay * t.weight_decay_multiplier),
                    step->bias_correction1, step->bias_correction2};
  if (first + kAdamWPerThread <= t.n && adamw_vectorizable(t)) {
    float4 m = *reinterpret_cast<const float4*>(t.m + first), v = *reinterpret_cast<const float4*>(t.v + first);
    float4 p = *reinterpret_cast<const float4*>(t.value + first);
    float4 e = t.ema ? *reinterpret_cast<const float4*>(t.ema + first) : float4{};
    float raw[kAdamWPerThread];
    if (t.grad_bf16) {
      const uint2 packed = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(t.grad) + first);
      const auto* g16 = reinterpret_cast<const bf16*>(&packed);
      for (int i = 0; i < kAdamWPerThread; ++i) raw[i] = __bfloat162float(g16[i]);
    } else {
      const float4 g = *reinterpret_cast<const float4*>(static_cast<const float*>(t.grad) + first);
      raw[0] = g.x, raw[1] = g.y, raw[2] = g.z, raw[3] = g.w;
    }
    float* ema = t.ema ? &e.x : nullptr;
    adamw_element(a, s, raw[0], m.x, v.x, p.x, ema);
    adamw_element(a, s, raw[1], m.y, v.y, p.y, ema ? &e.y : nullptr);
    adamw_element(a, s, raw[2], m.z, v.z, p.z, ema ? &e.z : nullptr);
    adamw_element(a, s, raw[3], m.w, v.w, p.w, ema ? &e.w : nullptr);
    *reinterpret_cast<float4*>(t.m + first) = m;
    *reinterpret_cast<float4*>(t.v + first) = v;
    *reinterpret_cast<float4*>(t.value + first) = p;
    if (t.ema) *reinterpret_cast<float4*>(t.ema + first) = e;
    if (t.shadow) {
      bf16 out[kAdamWPerThread] = {__float2bfloat16(p.x), __float2bfloat16(p.y), __float2bfloat16(p.z),
                                   __float2bfloat16(p.w)};
      *reinterpret_cast<uint2*>(t.shadow + first) = *reinterpret_cast<const uint2*>(out);
    }
    return;
  }
  for (int64_t j = first; j < t.n && j < first + kAdamWPerThread; ++j) {
    float m = t.m[j], v = t.v[j], p = t.value[j];
    adamw_element(a, s, grad_at(t, j), m, v, p, t.ema ? t.ema + j : nullptr);
    t.m[j] = m, t.v[j] = v, t.value[j] = p;
    if (t.shadow) t.shadow[j] = __float2bfloat16(p);
  }
}

// One block: the mean over experts (an exact integer sum), then each expert's step.
__global__ void selection_bias_kernel(const int32_t* counts, int64_t experts, double rate, double* bias,
                                      float* bias32) {
  __shared__ double mean;
  if (threadIdx.x == 0) {
    long long total = 0;
    for (int64_t e = 0; e < experts; ++e) total += counts[e];
    mean = double(total) / double(experts);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const double c = double(counts[e]);
    const double b = bias[e] + rate * (c < mean ? 1.0 : (c > mean ? -1.0 : 0.0));
    bias[e] = b;
    bias32[e] = float(b);
  }
}

}  // namespace

void embed_forward(const int32_t* tokens, const float* table, float scale, int64_t rows, int64_t d, float* h,
                   cudaStream_t s) {
  embed_forward_kernel<<<blocks_for(rows * d), kThreads, 0, s>>>(tokens, table, scale, rows, d, h);
}

void embed_backward(const int32_t* offsets, const int32_t* positions, const float* d_h, float scale, int64_t vocab,
                    int64_t d, float* grad, cudaStream_t s) {
  embed_backward_kernel<<<blocks_for(vocab * d), kThreads, 0, s>>>(offsets, positions, d_h, scale, vocab, d, grad);
}

void residual_rmsnorm_forward(const float* x, ResidualDelta delta, float* sum, float* saved, const float* gain,
                              int64_t rows, int64_t d, float eps, float* y, bf16* yb, float* inv_rms, cudaStream_t s) {
  residual_rmsnorm_kernel<<<blocks_for(rows, kWarps), kThreads, 0, s>>>(x, delta, sum, saved, gain, rows, d, eps, y,
                                                                         yb, inv_rms);
}

void rmsnorm_backward(const float* x, const float* gain, const float* inv_rms, NormGrad dy, int64_t rows, int64_t d,
                      bool accumulate, float* dx, bf16* dx16, float* d_gain, float* gain_partials, cudaStream_t s) {
  rmsnorm_backward_rows<<<blocks_for(rows, kWarps), kThreads, 0, s>>>(x, gain, inv_rms, dy, rows, d, accumulate, dx,
                                                                       dx16);
  rmsnorm_gain_partials<<<dim3(blocks_for(d), kNormGainChunks), kThreads, 0, s>>>(x, inv_rms, dy, rows, d,
                                                                                   gain_partials);
  rmsnorm_gain_sum<<<blocks_for(d), kThreads, 0, s>>>(gain_partials, d, d_gain);
}

// `floats` of shared memory for a block of `kernel`, in bytes, or 0 when that is more than a
// block may have: the kernel then reads global memory.
template <typename Kernel>
size_t staging_bytes(Kernel kernel, int64_t floats) {
  const size_t bytes = size_t(floats) * sizeof(float);
  int device = 0, limit = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (bytes > size_t(limit)) return 0;
  MOKA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  return bytes;
}

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

namespace {

// Calls fn(std::integral_constant<int, HD>{}) with head_dim padded up to the kernels' HD.
template <typename Fn>
void with_padded_head_dim(int64_t head_dim, Fn&& fn) {
  if (head_dim <= 16) return fn(std::integral_constant<int, 16>{});
  if (head_dim <= 32) return fn(std::integral_constant<int, 32>{});
  if (head_dim <= 64) return fn(std::integral_constant<int, 64>{});
  return fn(std::integral_constant<int, 128>{});
}

// The shared memory a fused kernel needs, opted in; an Error where the device has less.
template <typename Kernel>
size_t flash_bytes(Kernel kernel, size_t floats) {
  const size_t bytes = staging_bytes(kernel, int64_t(floats));
  if (bytes == 0)
    throw Error(ErrorCode::unsupported_size, "the fused attention needs " + std::to_string(floats * sizeof(float)) +
                                            " bytes of shared memory per block, more than this GPU has");
  return bytes;
}

dim3 flash_grid(int64_t batch, int64_t seq, int64_t heads) {
  return dim3(unsigned(batch * heads), unsigned((seq + kFlashTile - 1) / kFlashTile));
}

}  // namespace

bool flash_attention_supports(int64_t head_dim) {
  if (head_dim < 1 || head_dim > kFlashMaxHeadDim) return false;
  int device = 0, limit = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  size_t floats = 0;
  with_padded_head_dim(head_dim, [&](auto hd) { floats = flash_backward_floats<decltype(hd)::value>(); });
  return floats * sizeof(float) <= size_t(limit);
}

void flash_attention_forward(const float* q, const float* k, const float* v, int64_t batch, int64_t seq,
                             int64_t heads, int64_t head_dim, float* lse, float* out, cudaStream_t s) {
  with_padded_head_dim(head_dim, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    const auto kernel = flash_forward_kernel<HD>;
    const size_t smem = flash_bytes(kernel, flash_forward_floats<HD>());
    kernel<<<flash_grid(batch, seq, heads), kFlashThreads, smem, s>>>({batch, seq, heads, head_dim}, q, k, v, lse,
                                                                      out);
  });
}

void flash_attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                              const float* d_out, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                              float* row_dot, float* dq, float* dk, float* dv, cudaStream_t s) {
  with_padded_head_dim(head_dim, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    const AttnDims a{batch, seq, heads, head_dim};
    const dim3 grid = flash_grid(batch, seq, heads);
    const auto dq_kernel = flash_backward_dq_kernel<HD>;
    const auto dkv_kernel = flash_backward_dkv_kernel<HD>;
    const size_t smem = flash_bytes(dq_kernel, flash_backward_floats<HD>());
    flash_bytes(dkv_kernel, flash_backward_floats<HD>());
    dq_kernel<<<grid, kFlashThreads, smem, s>>>(a, q, k, v, out, lse, d_out, row_dot, dq);
    dkv_kernel<<<grid, kFlashThreads, smem, s>>>(a, q, k, v, lse, row_dot, d_out, dk, dv);
  });
}

void cross_entropy(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* row_loss,
                   float* d_logits, cudaStream_t s) {
  cross_entropy_kernel<<<blocks_for(rows, kWarps), kThreads, 0, s>>>(logits, targets, rows, vocab, row_loss, d_logits);
}

void reduce_partials(ReduceOp op, const void* x, bool is_bf16, int64_t n, double* partials, cudaStream_t s) {
  reduce_partials_kernel<<<kReduceBlocks, kThreads, 0, s>>>(op, x, is_bf16, n, partials);
}

void reduce_finish(const double* partials, int64_t count, double scale, double* out, cudaStream_t s) {
  reduce_finish_kernel<<<1, kThreads, 0, s>>>(partials, count, scale, out);
}

void to_bf16(const float* src, int64_t n, bf16* dst, cudaStream_t s) {
  to_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(src, n, dst);
}

int64_t assign_adamw_blocks(TensorSlot* slots, int count) {
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) {
    slots[i].first_block = blocks;
    blocks += blocks_for(slots[i].n, kThreads * kAdamWPerThread);
  }
  return blocks;
}

void grad_square_partials(const TensorSlot* slots, int count, double* partials, cudaStream_t s) {
  grad_square_partials_kernel<<<unsigned(count) * kReduceBlocks, kThreads, 0, s>>>(slots, partials);
}

void adamw_update(const AdamWHyper& a, const StepScalars* step, const double* grad_sum_squares,
                  const TensorSlot* slots, int count, int64_t blocks, cudaStream_t s) {
  adamw_kernel<<<unsigned(blocks), kThreads, 0, s>>>(a, step, grad_sum_squares, slots, count);
}

void update_selection_bias(const int32_t* counts, int64_t experts, double rate, double* bias, float* bias32,
                           cudaStream_t s) {
  selection_bias_kernel<<<1, kThreads, 0, s>>>(counts, experts, rate, bias, bias32);
}

}  // namespace moka::train::cuda
