// attention.cuh's fused kernels (--attention-kernel fused, the default): FlashAttention-style on
// TF32 tensor cores, the forward and the two backward kernels (dQ; dK and dV) with the shared
// memory layouts and tile loaders they need.
#include <mma.h>

#include <cmath>
#include <string>
#include <type_traits>

#include "train/cuda/ops/attention.cuh"
#include "train/cuda/ops/attention_common.cuh"
#include "train/cuda/ops/kernel_helpers.cuh"

namespace moka::train::cuda {
namespace {

// Fused (FlashAttention-style) attention on tensor cores: the same function as the reference
// kernels (attention.cu) without the seq x seq probabilities in global memory. The forward keeps,
// per query row, a running max and sum over key tiles (online softmax) and saves only the output
// and the row's logsumexp; the backward recomputes the probabilities tile by tile from it.
// Products run as TF32 WMMA (mma.sync) with fp32 accumulation, the softmax in fp32: the precision
// of the trainer's cuBLAS TF32 matmuls. Tiles: kFlashTile query rows by kFlashTile key rows per
// block iteration, 16 rows per warp; head_dim is zero-padded in shared memory to a multiple of 16
// (kFlashMaxHeadDim at most). Every output element has one writer and a fixed order of
// accumulation (dK and dV in key-tile blocks, dQ in query-tile blocks, each over the other tiles
// in order): no atomics, the same bits on every run.
constexpr int kFlashTile = 64;
constexpr int kFlashWarps = kFlashTile / 16;
constexpr int kFlashThreads = 32 * kFlashWarps;
constexpr int kFlashPad = 4;                      // floats per shared row (WMMA needs ld % 4 == 0)
constexpr int kScoreLd = kFlashTile + kFlashPad;  // a warp's 16 x kFlashTile score rows
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
  if (a.hd % 4 == 0 && reinterpret_cast<uintptr_t>(t) % 16 == 0) load_tile_by<HD, 4>(a, b, h, t, r0, tile);
  else load_tile_by<HD, 1>(a, b, h, t, r0, tile);
}

// src[bh * seq + q0 + r] for the tile's rows r (0 past seq): lse or row_dot of a query tile.
__device__ void load_row_values(const AttnDims& a, const float* src, int64_t bh, int64_t q0, float* to) {
  for (int r = threadIdx.x; r < kFlashTile; r += kFlashThreads)
    to[r] = q0 + r < a.seq ? src[bh * a.seq + q0 + r] : 0.0f;
}

// Rows [0, 16) of a warp's shared tile (pitch ld) to rows r0.. of head (b, h) of t, below seq.
__device__ void store_warp_rows(const AttnDims& a, int64_t b, int64_t h, const float* rows, int ld, int64_t r0,
                                float* t) {
  const int lane = threadIdx.x & 31;
  for (int r = 0; r < 16 && r0 + r < a.seq; ++r)
    for (int64_t c = lane; c < a.hd; c += 32) t[a.at(b, h, r0 + r) + c] = rows[r * ld + c];
}

template <int HD>
constexpr size_t flash_forward_floats() {
  return 4 * kFlashTile * (HD + kFlashPad) + kFlashWarps * kWarpScores;
}

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

void flash_attention_forward(const float* q, const float* k, const float* v, int64_t batch, int64_t seq, int64_t heads,
                             int64_t head_dim, float* lse, float* out, cudaStream_t s) {
  with_padded_head_dim(head_dim, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    const auto kernel = flash_forward_kernel<HD>;
    const size_t smem = flash_bytes(kernel, flash_forward_floats<HD>());
    kernel<<<flash_grid(batch, seq, heads), kFlashThreads, smem, s>>>({batch, seq, heads, head_dim}, q, k, v, lse, out);
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

}  // namespace moka::train::cuda
