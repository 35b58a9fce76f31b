#include "cuda/gemm/fp8_quantize.hpp"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <string>
#include <type_traits>

#include "core/fp8.hpp"
#include "cuda/common/check.hpp"
#include "moka/error.hpp"

namespace moka::cuda {
namespace {

using core::kFp8TileCols;

constexpr int kWarps = 8;                       // rows (or block rows' 16-row slices) per CTA
constexpr int kLaneValues = kFp8TileCols / 32;  // 4: a warp covers one 128-wide tile

// The N consecutive bf16 at p (2N-byte aligned: one 8- or 16-byte load) as floats, or zeros
// where they lie past the row (the caller's columns come in whole runs of N).
template <int N>
__device__ __forceinline__ void load_values(const __nv_bfloat16* p, bool in_row, float (&v)[N]) {
  static_assert(N == 4 || N == 8, "one 8- or 16-byte load");
  using Load = std::conditional_t<N == 4, uint2, uint4>;
  if (!in_row) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = 0.0f;
    return;
  }
  const Load q = *reinterpret_cast<const Load*>(p);
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}

// The codes of two values of a tile with scale s: e4m3(x / s) with IEEE division, converted by
// the hardware (cvt.rn.satfinite.e4m3x2.f32), whose rounding, saturation and NaN code
// core::float_to_e4m3 reproduces bit for bit (the Fp8Quantize tests compare every code); the
// software conversion costs ~20 instructions a value, which held the row quantizer near 1 TB/s
// (1.5-2.1 TB/s with this one). The weights' quantizer keeps core::quantize_e4m3: with this
// conversion it measured 0.52-0.64 TB/s against 0.78-0.92 (not yet understood; it runs once per
// optimizer step).
// Each value has its own scale (a column's, in quantize_columns_kernel) or both share one.
__device__ __forceinline__ uint32_t encode2(float a, float scale_a, float b, float scale_b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(a, scale_a), __fdiv_rn(b, scale_b)), __NV_SATFINITE, __NV_E4M3);
}

// The 4 codes of the lane's values in one 32-bit store (p 4-byte aligned).
__device__ __forceinline__ void store4(uint8_t* p, bool in_row, const float (&v)[kLaneValues], float scale) {
  if (!in_row) return;
  uint32_t word = 0;
  for (int i = 0; i < kLaneValues; ++i) word |= uint32_t(core::quantize_e4m3(v[i], scale)) << (8 * i);
  *reinterpret_cast<uint32_t*>(p) = word;
}

// The NaN-propagating max of |v| over each aligned group of `kLanes` lanes (core::nan_abs_max;
// fmaxf would drop a NaN): 32, the warp; 16, each half-warp.
template <int kLanes>
__device__ __forceinline__ float lanes_amax(float amax) {
  for (int d = kLanes / 2; d > 0; d /= 2) amax = core::nan_abs_max(amax, __shfl_xor_sync(0xFFFFFFFF, amax, d));
  return amax;
}

// One warp per row. A half-warp takes a 128-wide tile, lane l of it columns 8l..8l+7 (one 16-byte
// load); the warp loads kRowUnroll tile pairs before it reduces any, so that enough bytes are in
// flight per SM to keep HBM busy (one tile at a time ran at ~1 TB/s). cols % 8 == 0: a lane's 8
// values are all in the row or all past its end.
constexpr int kRowUnroll = 4;
constexpr int kHalfValues = 8;
__global__ void quantize_rows_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t ld,
                                     const int32_t* offsets, int segments, uint8_t* codes, float* scales) {
  const int lane = threadIdx.x % 32, half = lane / 16, sub = lane % 16;
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;
  int64_t first = 0, count = rows;  // the row's segment
  if (offsets) {
    int lo = 0, hi = segments;  // the last segment s with offsets[s] <= r
    if (r < offsets[0] || r >= offsets[segments]) return;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      (offsets[mid] <= r ? lo : hi) = mid;
    }
    first = offsets[lo], count = offsets[lo + 1] - first;
  }
  const int64_t col_tiles = core::fp8_tiles(cols, kFp8TileCols);
  for (int64_t t0 = 0; t0 < col_tiles; t0 += 2 * kRowUnroll) {
    float v[kRowUnroll][kHalfValues];
    int64_t c[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      c[u] = (t0 + 2 * u + half) * kFp8TileCols + sub * kHalfValues;
      load_values(x + r * ld + c[u], c[u] < cols, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kHalfValues; ++i) amax = core::nan_abs_max(amax, v[u][i]);
      const float scale = core::fp8_scale(lanes_amax<16>(amax));
      const int64_t t = t0 + 2 * u + half;
      if (t >= col_tiles) continue;
      if (c[u] < cols) {
        uint32_t w[2] = {0, 0};
#pragma unroll
        for (int i = 0; i < kHalfValues; i += 2)
          w[i / 4] |= encode2(v[u][i], scale, v[u][i + 1], scale) << (8 * (i % 4));
        *reinterpret_cast<uint2*>(codes + r * cols + c[u]) = make_uint2(w[0], w[1]);
      }
      if (sub == 0) scales[core::segment_scale_index(first, count, col_tiles, r, t)] = scale;
    }
  }
}

// One CTA per 128x128 block; warp w covers the block's rows w, w + 8, ... (16 of them, kept in
// registers between the amax and the quantization), lane l its columns 4l..4l+3. With codes_t,
// the block's codes also go through shared memory (rows 129 bytes apart, so the column reads
// below hit distinct banks) to the transposed matrix, written 4 bytes per thread along its rows.
constexpr int kBlockRows = int(core::kFp8BlockRows);
constexpr int kRowsPerWarp = kBlockRows / kWarps;
constexpr int kTilePitch = kBlockRows + 1;
__global__ void quantize_blocks_kernel(const __nv_bfloat16* w, int64_t rows, int64_t cols, uint8_t* codes,
                                       float* scales, uint8_t* codes_t, float* scales_t) {
  __shared__ float warp_amaxes[kWarps];
  __shared__ uint8_t tile[kBlockRows * kTilePitch];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col_blocks = core::fp8_tiles(cols, kFp8TileCols), row_blocks = core::fp8_tiles(rows, kBlockRows);
  const int64_t batch = blockIdx.z, rb = blockIdx.y, cb = blockIdx.x;
  const int64_t c = cb * kFp8TileCols + lane * kLaneValues;
  const __nv_bfloat16* in = w + batch * rows * cols;
  float v[kRowsPerWarp][kLaneValues];
  float amax = 0.0f;
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = rb * kBlockRows + warp + i * kWarps;
    load_values(in + r * cols + c, r < rows && c < cols, v[i]);
    for (float e : v[i]) amax = core::nan_abs_max(amax, e);
  }
  amax = lanes_amax<32>(amax);
  if (lane == 0) warp_amaxes[warp] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < kWarps; ++i) amax = core::nan_abs_max(amax, warp_amaxes[i]);
  const float scale = core::fp8_scale(amax);
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = rb * kBlockRows + warp + i * kWarps;
    if (r < rows) store4(codes + (batch * rows + r) * cols + c, c < cols, v[i], scale);
    if (codes_t)
      for (int j = 0; j < kLaneValues; ++j)
        tile[(warp + i * kWarps) * kTilePitch + lane * kLaneValues + j] = core::quantize_e4m3(v[i][j], scale);
  }
  if (threadIdx.x == 0) {
    scales[batch * col_blocks * row_blocks + cb * row_blocks + rb] = scale;
    if (scales_t) scales_t[batch * col_blocks * row_blocks + rb * col_blocks + cb] = scale;
  }
  if (!codes_t) return;
  __syncthreads();
  // The transposed block: its row j is column cb * 128 + j of w, 128 codes of rows rb * 128 + i.
  constexpr int kWords = kBlockRows * kBlockRows / 4;
  for (int word = threadIdx.x; word < kWords; word += kWarps * 32) {
    const int j = word / (kBlockRows / 4), i0 = (word % (kBlockRows / 4)) * 4;
    const int64_t col = cb * kFp8TileCols + j, row = rb * kBlockRows + i0;
    if (col >= cols || row >= rows) continue;
    uint32_t packed = 0;
    for (int u = 0; u < 4; ++u) packed |= uint32_t(tile[(i0 + u) * kTilePitch + j]) << (8 * u);
    *reinterpret_cast<uint32_t*>(codes_t + (batch * cols + col) * rows + row) = packed;
  }
}

// One CTA per 128-row block of a segment and 64 columns (a K-major copy's 64 rows): the block's
// bf16 rows go to shared memory (rows padded by 16 bytes, so that the lane-per-row reads below hit
// distinct banks), each column's amax over the block gives its scale, then lane i of a warp
// quantizes row i, 8 columns at a time, into the transposed tile (a column's 128 codes on one
// padded shared row), which leaves in 16-byte stores along the copy's rows. Rows past the segment
// are zeros in the tile: they leave every amax as it is and are not stored.
constexpr int kColumnChunk = 64;
constexpr int kColumnTilePitch = kColumnChunk + 8;  // bf16 per shared row
constexpr int kCodesPitch = kBlockRows + 16;        // bytes per shared transposed row
constexpr int kColumnThreads = 256;
constexpr int kRowQuarters = kColumnThreads / kColumnChunk;  // the amax pass: a quarter of the rows per thread
__global__ void __launch_bounds__(kColumnThreads)
    quantize_columns_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t ld, const int32_t* offsets,
                            int segments, int64_t pitch, uint8_t* codes, float* scales) {
  __shared__ alignas(16) __nv_bfloat16 tile[kBlockRows * kColumnTilePitch];
  __shared__ alignas(16) uint8_t coded[kColumnChunk * kCodesPitch];
  __shared__ float partial[kRowQuarters][kColumnChunk];
  __shared__ float scale_of[kColumnChunk];
  // This block slot's segment: the last one whose first block is at or before it (empty segments
  // share their block with the next).
  const int64_t slot = blockIdx.x;
  int segment = 0;
  int64_t first = 0, end = rows;
  if (offsets) {
    if (slot < core::transposed_block(offsets[0], 0)) return;
    int lo = 0, hi = segments;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      (core::transposed_block(offsets[mid], mid) <= slot ? lo : hi) = mid;
    }
    segment = lo, first = offsets[lo], end = offsets[lo + 1];
  }
  const int64_t first_block = core::transposed_block(first, segment), block = slot - first_block;
  const int64_t r0 = first + block * kBlockRows;
  if (r0 >= end) return;  // a slot between segments
  const int block_rows = int(end - r0 < kBlockRows ? end - r0 : kBlockRows);
  const int64_t c0 = int64_t(blockIdx.y) * kColumnChunk;
  const int tid = threadIdx.x;

  constexpr int kLoadRows = kColumnThreads / (kColumnChunk / kHalfValues);  // 32 rows per pass
  {
    const int part = tid % (kColumnChunk / kHalfValues), row = tid / (kColumnChunk / kHalfValues);
    const int64_t c = c0 + part * kHalfValues;
    uint4 q[kBlockRows / kLoadRows];
#pragma unroll
    for (int p = 0; p < kBlockRows / kLoadRows; ++p) {
      const int i = row + p * kLoadRows;
      q[p] =
          i < block_rows && c < cols ? *reinterpret_cast<const uint4*>(x + (r0 + i) * ld + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int p = 0; p < kBlockRows / kLoadRows; ++p)
      *reinterpret_cast<uint4*>(&tile[(row + p * kLoadRows) * kColumnTilePitch + part * kHalfValues]) = q[p];
  }
  __syncthreads();
  {
    const int col = tid % kColumnChunk, quarter = tid / kColumnChunk;
    constexpr int kQuarterRows = kBlockRows / kRowQuarters;
    float amax = 0.0f;
    for (int i = quarter * kQuarterRows; i < (quarter + 1) * kQuarterRows; ++i)
      amax = core::nan_abs_max(amax, __bfloat162float(tile[i * kColumnTilePitch + col]));
    partial[quarter][col] = amax;
  }
  __syncthreads();
  if (tid < kColumnChunk) {
    float amax = partial[0][tid];
    for (int q = 1; q < kRowQuarters; ++q) amax = core::nan_abs_max(amax, partial[q][tid]);
    const float scale = core::fp8_scale(amax);
    scale_of[tid] = scale;
    if (c0 + tid < cols) scales[(first_block + block) * cols + c0 + tid] = scale;
  }
  __syncthreads();
  {
    const int lane = tid % 32, chunk = tid / 32;  // columns chunk * 8 .. + 7
    float scale[kHalfValues];
#pragma unroll
    for (int j = 0; j < kHalfValues; ++j) scale[j] = scale_of[chunk * kHalfValues + j];
#pragma unroll
    for (int i = lane; i < kBlockRows; i += 32) {
      float v[kHalfValues];
      load_values(&tile[i * kColumnTilePitch + chunk * kHalfValues], true, v);
#pragma unroll
      for (int j = 0; j < kHalfValues; j += 2) {
        const uint32_t two = encode2(v[j], scale[j], v[j + 1], scale[j + 1]);
        coded[(chunk * kHalfValues + j) * kCodesPitch + i] = uint8_t(two);
        coded[(chunk * kHalfValues + j + 1) * kCodesPitch + i] = uint8_t(two >> 8);
      }
    }
  }
  __syncthreads();
  const int64_t out_col = core::transposed_column(first, segment) + block * kBlockRows;
  constexpr int kRuns = kBlockRows / 16;  // 16-byte runs per transposed row
  for (int item = tid; item < kColumnChunk * kRuns; item += kColumnThreads) {
    const int col = item / kRuns, i0 = (item % kRuns) * 16;
    if (c0 + col >= cols || i0 >= block_rows) continue;
    uint8_t* dst = codes + (c0 + col) * pitch + out_col + i0;
    const uint8_t* src = &coded[col * kCodesPitch + i0];
    if (i0 + 16 <= block_rows) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    else
      for (int j = 0; j < block_rows - i0; ++j) dst[j] = src[j];
  }
}

// `width` bf16 per load: the column count and row pitch must be multiples of it, the input aligned.
void require_quantizable(int64_t cols, int64_t ld, const void* x, int width, const char* what) {
  require(cols > 0 && cols % width == 0 && ld % width == 0 && reinterpret_cast<uintptr_t>(x) % (2 * width) == 0,
          ErrorCode::unsupported_size,
          std::string(what) + ": e4m3 quantization reads " + std::to_string(width) +
              " bf16 at a time; it needs a column count and a row pitch that are multiples of " +
              std::to_string(width) + " and an input aligned to that, got " + std::to_string(cols) +
              " columns, pitch " + std::to_string(ld));
}

}  // namespace

void quantize_rows_e4m3(const void* x, int64_t rows, int64_t cols, int64_t ld, const int32_t* offsets, int segments,
                        uint8_t* codes, float* scales, cudaStream_t stream) {
  require_quantizable(cols, ld, x, kHalfValues, "quantize_rows_e4m3");
  require(!offsets || segments > 0, ErrorCode::invalid_argument, "quantize_rows_e4m3: offsets with no segments");
  if (rows <= 0) return;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  quantize_rows_kernel<<<unsigned(blocks), kWarps * 32, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols,
                                                                     ld, offsets, segments, codes, scales);
  MOKA_CUDA_CHECK_LAUNCH();
}

void quantize_columns_e4m3(const void* x, int64_t rows, int64_t cols, int64_t ld, const int32_t* offsets, int segments,
                           uint8_t* codes, float* scales, cudaStream_t stream) {
  require_quantizable(cols, ld, x, kHalfValues, "quantize_columns_e4m3");
  require(!offsets || segments > 0, ErrorCode::invalid_argument, "quantize_columns_e4m3: offsets with no segments");
  require(reinterpret_cast<uintptr_t>(codes) % 16 == 0, ErrorCode::unsupported_size,
          "quantize_columns_e4m3: the codes are written in 16-byte runs; their base must be 16-byte aligned");
  if (rows <= 0) return;
  const int cut = offsets ? segments : 1;
  const int64_t slots = core::transposed_blocks(rows, cut), chunks = core::fp8_tiles(cols, kColumnChunk);
  require(slots < (int64_t(1) << 31) && chunks <= 65535, ErrorCode::unsupported_size,
          "quantize_columns_e4m3: more than 2^31 row blocks or 65535 column chunks");
  quantize_columns_kernel<<<dim3(unsigned(slots), unsigned(chunks)), kColumnThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), rows, cols, ld, offsets, segments, core::transposed_pitch(rows, cut), codes,
      scales);
  MOKA_CUDA_CHECK_LAUNCH();
}

void quantize_blocks_e4m3(const void* w, int64_t batch, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                          uint8_t* codes_t, float* scales_t, cudaStream_t stream) {
  require_quantizable(cols, cols, w, kLaneValues, "quantize_blocks_e4m3");
  require(!codes_t == !scales_t, ErrorCode::invalid_argument,
          "quantize_blocks_e4m3: the transposed codes and scales go together");
  require(!codes_t || rows % 16 == 0, ErrorCode::unsupported_size,
          "quantize_blocks_e4m3: the transposed codes' rows are " + std::to_string(rows) +
              " codes long; the e4m3 GEMM reads them in 16-byte runs, so they must be a multiple of 16");
  if (batch <= 0 || rows <= 0) return;
  require(batch <= 65535 && core::fp8_tiles(rows, kBlockRows) <= 65535, ErrorCode::unsupported_size,
          "quantize_blocks_e4m3: more than 65535 experts or 128-row blocks");
  const dim3 grid(unsigned(core::fp8_tiles(cols, kFp8TileCols)), unsigned(core::fp8_tiles(rows, kBlockRows)),
                  unsigned(batch));
  quantize_blocks_kernel<<<grid, kWarps * 32, 0, stream>>>(static_cast<const __nv_bfloat16*>(w), rows, cols, codes,
                                                           scales, codes_t, scales_t);
  MOKA_CUDA_CHECK_LAUNCH();
}

}  // namespace moka::cuda
