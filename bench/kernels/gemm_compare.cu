// gemm_compare.hpp's comparison: one grid-stride pass over both buffers, 16 bytes at a time, each
// warp's findings folded into the result with one atomic per field.
#include <cstring>

#include "cuda/common/check.hpp"
#include "gemm_compare.hpp"

namespace moka::lab {
namespace {

using ull = unsigned long long;

struct Found {
  ull differing = 0, unwritten = 0, extra = 0, non_finite = 0, first = ~0ull;
  unsigned int max_diff = 0, max_want = 0;  // non-negative floats order as their bits do
};

__device__ bool finite_bf16(unsigned short b) { return (b & 0x7F80u) != 0x7F80u; }
__device__ float bf16_value(unsigned short b) { return __uint_as_float(static_cast<unsigned int>(b) << 16); }

__device__ void visit(unsigned short g, unsigned short w, ull i, Found& f) {
  const bool g_written = g != kUnwrittenBits, w_written = w != kUnwrittenBits;
  if (w_written && finite_bf16(w)) f.max_want = max(f.max_want, __float_as_uint(fabsf(bf16_value(w))));
  if (g == w) return;
  ++f.differing;
  f.first = min(f.first, i);
  if (!g_written) {
    ++f.unwritten;
  } else if (!w_written) {
    ++f.extra;
  } else if (!finite_bf16(g) || !finite_bf16(w)) {
    ++f.non_finite;
  } else {
    f.max_diff = max(f.max_diff, __float_as_uint(fabsf(bf16_value(g) - bf16_value(w))));
  }
}

__global__ void reset(BufferDiff* r) { *r = BufferDiff{}; }

__global__ void compare(const unsigned short* got, const unsigned short* want, ull count, BufferDiff* r) {
  Found f;
  const ull stride = ull(gridDim.x) * blockDim.x, first_thread = ull(blockIdx.x) * blockDim.x + threadIdx.x;
  const ull vectors = count / 8;  // cudaMalloc'd bases: 16-byte aligned
  const uint4* g4 = reinterpret_cast<const uint4*>(got);
  const uint4* w4 = reinterpret_cast<const uint4*>(want);
  for (ull v = first_thread; v < vectors; v += stride) {
    const uint4 gv = g4[v], wv = w4[v];
    const unsigned int gw[4] = {gv.x, gv.y, gv.z, gv.w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (gw[j] == ww[j]) {  // the common case: only the scale to update
        visit(static_cast<unsigned short>(ww[j]), static_cast<unsigned short>(ww[j]), 0, f);
        visit(static_cast<unsigned short>(ww[j] >> 16), static_cast<unsigned short>(ww[j] >> 16), 0, f);
        continue;
      }
      visit(static_cast<unsigned short>(gw[j]), static_cast<unsigned short>(ww[j]), 8 * v + 2 * j, f);
      visit(static_cast<unsigned short>(gw[j] >> 16), static_cast<unsigned short>(ww[j] >> 16), 8 * v + 2 * j + 1, f);
    }
  }
  for (ull i = 8 * vectors + first_thread; i < count; i += stride) visit(got[i], want[i], i, f);
  for (int o = 16; o > 0; o /= 2) {
    f.differing += __shfl_xor_sync(0xFFFFFFFFu, f.differing, o);
    f.unwritten += __shfl_xor_sync(0xFFFFFFFFu, f.unwritten, o);
    f.extra += __shfl_xor_sync(0xFFFFFFFFu, f.extra, o);
    f.non_finite += __shfl_xor_sync(0xFFFFFFFFu, f.non_finite, o);
    f.first = min(f.first, __shfl_xor_sync(0xFFFFFFFFu, f.first, o));
    f.max_diff = max(f.max_diff, __shfl_xor_sync(0xFFFFFFFFu, f.max_diff, o));
    f.max_want = max(f.max_want, __shfl_xor_sync(0xFFFFFFFFu, f.max_want, o));
  }
  if (threadIdx.x % 32 != 0) return;
  if (f.differing != 0) {
    atomicAdd(&r->differing, f.differing);
    atomicAdd(&r->unwritten, f.unwritten);
    atomicAdd(&r->extra, f.extra);
    atomicAdd(&r->non_finite, f.non_finite);
    atomicMin(&r->first, f.first);
    atomicMax(&r->max_diff_bits, f.max_diff);
  }
  atomicMax(&r->max_want_bits, f.max_want);
}

__global__ void fetch_first(const unsigned short* got, const unsigned short* want, BufferDiff* r) {
  if (r->first == ~0ull) return;
  r->first_got = got[r->first];
  r->first_want = want[r->first];
}

}  // namespace

void compare_bf16(const void* got, const void* want, size_t count, BufferDiff* result, cudaStream_t s) {
  const auto* g = static_cast<const unsigned short*>(got);
  const auto* w = static_cast<const unsigned short*>(want);
  reset<<<1, 1, 0, s>>>(result);
  MOKA_CUDA_CHECK_LAUNCH();
  if (count > 0) {
    compare<<<1056, 256, 0, s>>>(g, w, count, result);  // 8 blocks per SM of an H200
    MOKA_CUDA_CHECK_LAUNCH();
  }
  fetch_first<<<1, 1, 0, s>>>(g, w, result);
  MOKA_CUDA_CHECK_LAUNCH();
}

float float_of_bits(unsigned int bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
float float_of_bf16_bits(unsigned short bits) { return float_of_bits(static_cast<unsigned int>(bits) << 16); }

}  // namespace moka::lab
