#include <algorithm>
#include <cmath>

#include "core/activation.hpp"
#include "core/schedule.hpp"
#include "cuda/common/check.hpp"
#include "cuda/layer/layer_kernels.hpp"

namespace moka::cuda {
namespace {

constexpr int kRowThreads = 128;
constexpr int kVec = 8;  // bf16 per 16-byte access

struct alignas(16) Vec8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ void load8(const bf16* p, float (&v)[kVec]) {
  const Vec8 q = *reinterpret_cast<const Vec8*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(q.h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(bf16* p, const float (&v)[kVec]) {
  Vec8 q;
#pragma unroll
  for (int i = 0; i < 4; ++i) q.h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<Vec8*>(p) = q;
}


// --- schedule -------------------------------------------------------------------------------

// Bin of a (source, slot) route: local expert * world_size + source; -1 when not local.
__device__ __forceinline__ int64_t bin_of(const DeviceSchedule& s, int32_t id, int64_t global_slot) {
  const int64_t e = int64_t(id) - s.first_expert;
  if (e < 0 || e >= s.num_experts) return -1;
  return e * s.world_size + global_slot / s.slots;
}

// Per-chunk histogram of bins (integer shared-memory atomics: the result is exact).
__global__ void count_chunks(DeviceSchedule s, const int32_t* ids) {
  extern __shared__ int32_t hist[];
  const int64_t bins = s.num_experts * s.world_size;
  for (int64_t b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const int64_t slot = int64_t(blockIdx.x) * kScheduleChunk + threadIdx.x;
  if (slot < s.slots * s.world_size) {
    const int64_t b = bin_of(s, ids[slot], slot);
    if (b >= 0) atomicAdd(&hist[b], 1);
  }
  __syncthreads();
  for (int64_t b = threadIdx.x; b < bins; b += blockDim.x) s.chunk_counts[blockIdx.x * bins + b] = hist[b];
}

// Per bin: exclusive scan of its chunk counts (in place) and its total; per expert the sum over
// sources; then the padded segment offsets, scanned in expert order by one thread (E is at most
// a few thousand).
__global__ void scan_experts(DeviceSchedule s, int64_t chunks) {
  const int64_t bins = s.num_experts * s.world_size;
  int32_t* per_bin = s.source_counts ? s.source_counts : s.counts;  // one source: bins are experts
  for (int64_t b = threadIdx.x; b < bins; b += blockDim.x) {
    int32_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t* p = &s.chunk_counts[c * bins + b];
      const int32_t v = *p;
      *p = run;
      run += v;
    }
    per_bin[b] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t off = 0;
    for (int64_t e = 0; e < s.num_experts; ++e) {
      if (s.source_counts) {
        int32_t total = 0;
        for (int r = 0; r < s.world_size; ++r) total += s.source_counts[e * s.world_size + r];
        s.counts[e] = total;
      }
      s.offsets[e] = static_cast<int32_t>(off);
      off += core::round_up(s.counts[e], s.tile_rows);
    }
    s.offsets[s.num_experts] = static_cast<int32_t>(off);
  }
}

// Row of every route: its index among the routes of its (expert, source) in slot order, placed
// by the shared row-order rule.
__global__ void place_rows(DeviceSchedule s, const int32_t* ids) {
  __shared__ int64_t chunk_bins[kScheduleChunk];
  const int64_t base = int64_t(blockIdx.x) * kScheduleChunk;
  const int64_t slot = base + threadIdx.x;
  const int64_t all_slots = s.slots * s.world_size;
  chunk_bins[threadIdx.x] = slot < all_slots ? bin_of(s, ids[slot], slot) : -1;
  __syncthreads();
  if (slot >= all_slots) return;
  const int64_t b = chunk_bins[threadIdx.x];
  if (b < 0) {
    s.row_of_slot[slot] = -1;
    return;
  }
  const int64_t bins = s.num_experts * s.world_size;
  int64_t index = s.chunk_counts[blockIdx.x * bins + b];
  for (int i = 0; i < int(threadIdx.x); ++i) index += chunk_bins[i] == b;
  const int64_t e = b / s.world_size;
  const int source = static_cast<int>(b % s.world_size);
  int64_t counts[kMaxScheduleSources];
  const int32_t* per_source = s.source_counts ? s.source_counts + e * s.world_size : s.counts + e;
  for (int r = 0; r < s.world_size; ++r) counts[r] = per_source[r];
  core::ScheduleDims dims;
  dims.world_size = s.world_size;
  dims.row_order = s.row_order;
  dims.rank = s.rank;
  s.row_of_slot[slot] = static_cast<int32_t>(s.offsets[e] + core::row_position(dims, counts, source, index));
}

// Input checks on the device (the host never reads the routing): the lowest bad slot wins, so
// the reported entry is deterministic. Bad ids are also harmless to the other kernels (they are
// dropped as non-local).
__global__ void check_routing(DeviceSchedule s, const int32_t* ids, const float* weights) {
  const int64_t slot = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= s.slots) return;
  const int32_t id = ids[slot];
  unsigned long long code = 0;
  if (id < 0 || id >= s.global_experts) {
    code = 1;
  } else if (!isfinite(weights[slot])) {
    code = 3;
  } else {
    const int64_t j = slot % s.top_k;
    for (int64_t i = 1; i <= j; ++i)
      if (ids[slot - i] == id) code = 2;
  }
  if (code) atomicMin(s.error, (static_cast<unsigned long long>(slot) << 2) | code);
}

// --- rows -----------------------------------------------------------------------------------

// One block per token: each thread loads its part of the token's row once and stores it into the
// rows of the token's k slots. Timed alone on the H200 at 16384 tokens, this writes 2.4-3.0 TB/s
// of rows against 2.0-2.2 for a warp per slot that reads the token's row k times (qwen3-30b-a3b
// 0.26 -> 0.18 ms, deepseek-v3 0.87 -> 0.62 ms; a TMA bulk copy through shared memory was 1-15%
// faster again, at the cost of a barrier wait: bench/results/gather-rows-h200-2026-12-03-s18.jsonl).
constexpr int kGatherThreads = 128;
constexpr int kGatherLoads = 4;  // 16-byte loads in flight per thread before its stores

__global__ void __launch_bounds__(kGatherThreads)
    gather_rows_kernel(const bf16* __restrict__ src, bf16* __restrict__ dst, const int32_t* __restrict__ row_of_slot,
                       int64_t slots, int64_t top_k, int64_t width) {
  const int64_t token = blockIdx.x, vecs = width / kVec;
  const int64_t first_slot = token * top_k, token_slots = std::min(top_k, slots - first_slot);
  const Vec8* s = reinterpret_cast<const Vec8*>(src + token * width);
  for (int64_t first = threadIdx.x; first < vecs; first += kGatherThreads * kGatherLoads) {
    Vec8 v[kGatherLoads];
#pragma unroll
    for (int i = 0; i < kGatherLoads; ++i)
      if (first + kGatherThreads * i < vecs) v[i] = s[first + kGatherThreads * i];
    for (int64_t j = 0; j < token_slots; ++j) {
      const int32_t row = row_of_slot[first_slot + j];
      if (row < 0) continue;
      Vec8* d = reinterpret_cast<Vec8*>(dst + int64_t(row) * width);
#pragma unroll
      for (int i = 0; i < kGatherLoads; ++i)
        if (first + kGatherThreads * i < vecs) d[first + kGatherThreads * i] = v[i];
    }
  }
}

__global__ void gather_scalars_kernel(const float* src, float* dst, const int32_t* index, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[index[i]];
}

__global__ void scatter_scalars_kernel(const float* src, float* dst, const int32_t* index, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[index[i]] = src[i];
}

__device__ __forceinline__ int64_t row_of(const int32_t* row_of_slot, int64_t i) {
  return row_of_slot ? row_of_slot[i] : i;
}

__global__ void swiglu_forward_kernel(const bf16* gate, const bf16* up, bf16* hidden, const int32_t* row_of_slot,
                                      int64_t width, ActParams act) {
  const int64_t row = row_of(row_of_slot, blockIdx.x);
  if (row < 0) return;
  const int64_t base = row * width;
  for (int64_t c = threadIdx.x * kVec; c < width; c += blockDim.x * kVec) {
    float g[kVec], u[kVec], h[kVec];
    load8(gate + base + c, g);
    load8(up + base + c, u);
#pragma unroll
    for (int i = 0; i < kVec; ++i) h[i] = core::swiglu_forward<float>(g[i], u[i], act.clamped, act.limit);
    store8(hidden + base + c, h);
  }
}

// Fixed-shape tree reduction over the block: deterministic for a given blockDim.
__device__ float block_sum(float v) {
  __shared__ float partial[kRowThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0;
#pragma unroll
  for (int w = 0; w < kRowThreads / 32; ++w) total += partial[w];
  return total;
}

__global__ void __launch_bounds__(kRowThreads)
    swiglu_backward_kernel(const bf16* gate, const bf16* up, const bf16* dh_u, const float* weights, float* d_weight,
                           bf16* scaled_hidden, bf16* d_gate, bf16* d_up, const int32_t* row_of_slot, int64_t width,
                           ActParams act) {
  const int64_t row = row_of(row_of_slot, blockIdx.x);
  if (row < 0) return;
  const float w = weights ? weights[blockIdx.x] : 1.0f;
  const int64_t base = row * width;
  float dot = 0;
  for (int64_t c = threadIdx.x * kVec; c < width; c += blockDim.x * kVec) {
    float g[kVec], u[kVec], h[kVec], dh[kVec], dg[kVec], du[kVec];
    load8(gate + base + c, g);
    load8(up + base + c, u);
    load8(dh_u + base + c, dh);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      // The forward's hidden value, bit for bit (its bf16 rounding included): recomputed, not saved.
      h[i] = __bfloat162float(__float2bfloat16_rn(core::swiglu_forward<float>(g[i], u[i], act.clamped, act.limit)));
      dot += dh[i] * h[i];
      core::swiglu_backward<float>(g[i], u[i], w * dh[i], act.clamped, act.limit, dg[i], du[i]);
      h[i] *= w;
    }
    store8(d_gate + base + c, dg);
    store8(d_up + base + c, du);
    if (scaled_hidden) store8(scaled_hidden + base + c, h);
  }
  if (d_weight) {
    const float total = block_sum(dot);
    if (threadIdx.x == 0) d_weight[blockIdx.x] = total;
  }
}

__global__ void combine_kernel(const bf16* y, const float* weights, const bf16* shared, bf16* out,
                               const int32_t* row_of_slot, int64_t top_k, int64_t width) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x * kVec; c < width; c += blockDim.x * kVec) {
    float acc[kVec] = {};
    if (shared) load8(shared + t * width + c, acc);
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t row = row_of(row_of_slot, t * top_k + j);
      if (row < 0) continue;
      const float w = weights[t * top_k + j];
      float v[kVec];
      load8(y + int64_t(row) * width + c, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += w * v[i];
    }
    store8(out + t * width + c, acc);
  }
}

__global__ void reduce_grads_kernel(const bf16* ra, const bf16* rb, const bf16* sa, const bf16* sb, bf16* d_x,
                                    const int32_t* row_of_slot, int64_t top_k, int64_t width) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x * kVec; c < width; c += blockDim.x * kVec) {
    float acc[kVec] = {};
    if (sa) {
      float a[kVec], b[kVec];
      load8(sa + t * width + c, a);
      load8(sb + t * width + c, b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = a[i] + b[i];
    }
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = row_of_slot[t * top_k + j];
      if (row < 0) continue;
      float a[kVec], b[kVec];
      load8(ra + int64_t(row) * width + c, a);
      load8(rb + int64_t(row) * width + c, b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += a[i] + b[i];
    }
    store8(d_x + t * width + c, acc);
  }
}

__global__ void zero_empty_kernel(const int32_t* counts, bf16* a, bf16* b, bf16* c, int64_t per_expert) {
  const int64_t e = blockIdx.y;
  if (counts[e] != 0) return;
  const int64_t n = per_expert / kVec;
  const Vec8 zero{};
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    reinterpret_cast<Vec8*>(a + e * per_expert)[i] = zero;
    reinterpret_cast<Vec8*>(b + e * per_expert)[i] = zero;
    reinterpret_cast<Vec8*>(c + e * per_expert)[i] = zero;
  }
}

unsigned grid_of(int64_t blocks) { return static_cast<unsigned>(blocks); }

}  // namespace

int64_t schedule_chunks(int64_t slots) { return (slots + kScheduleChunk - 1) / kScheduleChunk; }

void build_schedule(const DeviceSchedule& s, const int32_t* topk_ids, const float* topk_weights, cudaStream_t stream) {
  require(s.world_size >= 1 && s.world_size <= kMaxScheduleSources, ErrorCode::unsupported_size,
          "the device schedule takes 1 to " + std::to_string(kMaxScheduleSources) + " source ranks");
  require(s.world_size == 1 || s.source_counts != nullptr, ErrorCode::invalid_argument,
          "a schedule over several source ranks needs source_counts");
  const int64_t all_slots = s.slots * s.world_size;
  const int64_t chunks = schedule_chunks(all_slots);
  const size_t hist_bytes = s.num_experts * s.world_size * sizeof(int32_t);
  require(hist_bytes <= 48 * 1024, ErrorCode::unsupported_size,
          "the device schedule takes at most 12288 (local expert, source) pairs");
  if (all_slots > 0) {
    if (s.world_size == 1) {
      check_routing<<<grid_of((s.slots + 255) / 256), 256, 0, stream>>>(s, topk_ids, topk_weights);
      MOKA_CUDA_CHECK_LAUNCH();
    }
    count_chunks<<<grid_of(chunks), kScheduleChunk, hist_bytes, stream>>>(s, topk_ids);
    MOKA_CUDA_CHECK_LAUNCH();
  }
  scan_experts<<<1, 1024, 0, stream>>>(s, chunks);
  MOKA_CUDA_CHECK_LAUNCH();
  if (all_slots > 0) {
    place_rows<<<grid_of(chunks), kScheduleChunk, 0, stream>>>(s, topk_ids);
    MOKA_CUDA_CHECK_LAUNCH();
  }
}

void gather_rows(const bf16* src, bf16* dst, const int32_t* row_of_slot, int64_t slots, int64_t top_k, int64_t width,
                 cudaStream_t stream) {
  if (slots == 0) return;
  gather_rows_kernel<<<grid_of((slots + top_k - 1) / top_k), kGatherThreads, 0, stream>>>(src, dst, row_of_slot, slots,
                                                                                          top_k, width);
  MOKA_CUDA_CHECK_LAUNCH();
}

void gather_scalars(const float* src, float* dst, const int32_t* index, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gather_scalars_kernel<<<grid_of((n + 255) / 256), 256, 0, stream>>>(src, dst, index, n);
  MOKA_CUDA_CHECK_LAUNCH();
}

void scatter_scalars(const float* src, float* dst, const int32_t* index, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  scatter_scalars_kernel<<<grid_of((n + 255) / 256), 256, 0, stream>>>(src, dst, index, n);
  MOKA_CUDA_CHECK_LAUNCH();
}

Error routing_error(unsigned long long code, int64_t top_k, int64_t num_experts, const std::string& context) {
  const int64_t slot = static_cast<int64_t>(code >> 2), t = slot / top_k, j = slot % top_k;
  const std::string what = context + "topk_ids/topk_weights[" + std::to_string(t) + ", " + std::to_string(j) + "]: ";
  switch (code & 3) {
    case 1:
      return Error(ErrorCode::expert_out_of_range, what + "expert id outside [0, " + std::to_string(num_experts) + ")");
    case 2: return Error(ErrorCode::duplicate_expert, what + "the same expert twice in one token's top-k");
    default: return Error(ErrorCode::non_finite, what + "non-finite weight");
  }
}

void swiglu_forward_rows(const bf16* gate, const bf16* up, bf16* hidden, const int32_t* row_of_slot, int64_t rows,
                         int64_t width, ActParams act, cudaStream_t stream) {
  if (rows == 0) return;
  swiglu_forward_kernel<<<grid_of(rows), kRowThreads, 0, stream>>>(gate, up, hidden, row_of_slot, width, act);
  MOKA_CUDA_CHECK_LAUNCH();
}

void swiglu_backward_rows(const bf16* gate, const bf16* up, const bf16* dh_u, const float* weights, float* d_weight,
                          bf16* scaled_hidden, bf16* d_gate, bf16* d_up, const int32_t* row_of_slot, int64_t rows,
                          int64_t width, ActParams act, cudaStream_t stream) {
  if (rows == 0) return;
  swiglu_backward_kernel<<<grid_of(rows), kRowThreads, 0, stream>>>(gate, up, dh_u, weights, d_weight, scaled_hidden,
                                                                    d_gate, d_up, row_of_slot, width, act);
  MOKA_CUDA_CHECK_LAUNCH();
}

void combine_tokens(const bf16* y, const float* weights, const bf16* shared, bf16* out, const int32_t* row_of_slot,
                    int64_t tokens, int64_t top_k, int64_t width, cudaStream_t stream) {
  if (tokens == 0) return;
  combine_kernel<<<grid_of(tokens), kRowThreads, 0, stream>>>(y, weights, shared, out, row_of_slot, top_k, width);
  MOKA_CUDA_CHECK_LAUNCH();
}

void reduce_input_grads(const bf16* ra, const bf16* rb, const bf16* sa, const bf16* sb, bf16* d_x,
                        const int32_t* row_of_slot, int64_t tokens, int64_t top_k, int64_t width, cudaStream_t stream) {
  if (tokens == 0) return;
  reduce_grads_kernel<<<grid_of(tokens), kRowThreads, 0, stream>>>(ra, rb, sa, sb, d_x, row_of_slot, top_k, width);
  MOKA_CUDA_CHECK_LAUNCH();
}

void zero_empty_experts(const int32_t* counts, int64_t experts, bf16* a, bf16* b, bf16* c, int64_t per_expert,
                        cudaStream_t stream) {
  const dim3 grid(32, static_cast<unsigned>(experts));
  zero_empty_kernel<<<grid, 256, 0, stream>>>(counts, a, b, c, per_expert);
  MOKA_CUDA_CHECK_LAUNCH();
}

}  // namespace moka::cuda
