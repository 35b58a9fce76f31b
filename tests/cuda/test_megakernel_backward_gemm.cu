// The megakernel's GEMM core (tile_gemm.cuh) with the backward's operand layouts, run alone:
// a test kernel whose CTAs run the core's warp-specialized tile loop (TMA thread + two consumer
// warpgroups, the k-block count carried across tiles) over every tile of one GEMM, against an
// fp64 CPU product of the same bf16 inputs.
//   dgd:   dH = d_out . W_down        A = d_out [rows, H] K-major, B = W_down[e] [H, I] MN-major
//   dx:    dg . W_gate + du . W_up    two products into one accumulator, B MN-major
//   wgrad: dW_down = d_out^T . h      A and B MN-major, K = rows
//          dW_gate|up^T = x^T . [dg | du]: two 128-column accumulators sharing x (the forward's
//          gate|up tile mirrored), K = a row range starting inside the ring
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <random>
#include <vector>

#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/megakernel/backward_epilogue.cuh"
#include "cuda/megakernel/forward_compute.cuh"

namespace moka::cuda::mk {
namespace {

inline constexpr int kMaxProducts = 2;

// An epilogue's start(acc, row_tile, col_tile): true when it loaded acc to continue from.
struct StartsFromZero {
  __device__ bool start(Accumulator&, int, int) const { return false; }
};

// The plain epilogue: the accumulator as bf16 into out[0] (m x n, row-major); with `pair`, the
// tile's left half into out[0] and its right half into out[1], 128 columns each; with
// `transposed` (pair only), the halves as n x m matrices (the gate|up weight gradients).
struct PlainStore : StartsFromZero {
  bf16* out[2] = {};
  int64_t m = 0, n = 0;
  bool pair = false, transposed = false;

  __device__ void operator()(const Accumulator& acc, int row_tile, int col_tile) const {
    const int64_t row0 = int64_t(row_tile) * kTileM;
    const TileOut o{row0, m - row0, int64_t(col_tile) * (pair ? kHalfN : kTileN), n};
    if (transposed) {
      store_transposed_halves(acc, out[0], out[1], o.row0, o.col0, m, n);
    } else if (pair) {
      store_rows<false>(acc, 0, out[0], o);
      store_rows<false>(acc, kAccumulatorSize / 2, out[1], o);
    } else {
      store_rows<true>(acc, 0, out[0], o);
    }
  }
};

// The dgd epilogue of the backward (backward_epilogue.cuh) on 256-column tiles.
struct DgdStore : StartsFromZero {
  DgdTile tile;  // row0, col0 and col_tile are set per tile

  __device__ void operator()(const Accumulator& acc, int row_tile, int col_tile) const {
    DgdTile t = tile;
    t.row0 = int64_t(row_tile) * kTileM;
    t.valid_rows -= t.row0;
    t.col0 = int64_t(col_tile) * kTileN;
    t.col_tile = col_tile;
    store_dgd_tile(acc, t);
  }
};

// A weight gradient's segment: the fp32 accumulator into `out` [m, n], starting from the carry
// `carry_in` [m, n] that an earlier segment left (null: from zero). 256-column tiles.
struct CarryStore {
  const float* carry_in = nullptr;
  float* out = nullptr;
  int64_t m = 0, n = 0;

  __device__ TileOut tile_out(int row_tile, int col_tile) const {
    const int64_t row0 = int64_t(row_tile) * kTileM;
    return {row0, m - row0, int64_t(col_tile) * kTileN, n};
  }
  __device__ bool start(Accumulator& acc, int row_tile, int col_tile) const {
    if (!carry_in) return false;
    load_carry(acc, carry_in, tile_out(row_tile, col_tile));
    return true;
  }
  __device__ void operator()(const Accumulator& acc, int row_tile, int col_tile) const {
    store_carry(acc, out, tile_out(row_tile, col_tile));
  }
};

// One GEMM on the core: D (m x n) = sum over products q of A_q B_q^T, over k-blocks
// [kblock0, kblock0 + kblocks) of K (kblocks 0: to K's end). pair: B_q0 and B_q1 fill the two 128-column halves of each
// tile; else one B of n rows (256-column tiles). The epilogue stores each finished tile.
template <Major MA, Major MB, class Epilogue>
struct CoreGemmParams {
  OperandOf<MA> a[kMaxProducts];
  OperandOf<MB> b[kMaxProducts][2];
  int products = 1, kblock0 = 0, kblocks = 0, expert = 0, tiles_m = 0, tiles_n = 0;
  bool pair = false;
  Epilogue epilogue;
  MegakernelControl* control = nullptr;
  uint64_t timeout_ns = 0;
};

template <Major MA, Major MB, class Epilogue>
__device__ TileLoadsOf<MA, MB> product_loads(const CoreGemmParams<MA, MB, Epilogue>& p, int product, int tile) {
  TileLoadsOf<MA, MB> l = tile_loads(p.a[product], tile % p.tiles_m, p.b[product][0],
                                     p.pair ? &p.b[product][1] : nullptr, tile / p.tiles_m, p.expert);
  l.kblock0 = p.kblock0;
  l.kblocks = p.kblocks > 0 ? p.kblocks : l.kblocks - p.kblock0;
  return l;
}

// Tiles blockIdx.x, blockIdx.x + gridDim.x, ...: with fewer CTAs than tiles the TMA thread
// loads the next tile's k-blocks while the consumers finish a tile, as in the megakernel.
template <Major MA, Major MB, class Epilogue>
__global__ void __launch_bounds__(kThreads, 1)
    core_gemm_kernel(const __grid_constant__ CoreGemmParams<MA, MB, Epilogue> p) {
  extern __shared__ char smem_raw[];
  auto& sm = *reinterpret_cast<TileSmem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    init_tile_pipeline(sm);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const PipelineWatch watch = make_watch(p.control, p.timeout_ns);
  const int tiles = p.tiles_m * p.tiles_n;
  if (is_consumer()) {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    uint32_t consumed = 0;
    Accumulator acc;
    for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
      int kblocks = 0;
      for (int q = 0; q < p.products; ++q) kblocks += product_loads(p, q, t).kblocks;
      const bool continue_acc = p.epilogue.start(acc, t % p.tiles_m, t / p.tiles_m);
      mma_tile<MA, MB>(sm, consumed, kblocks, acc, watch, TaskSite{}, continue_acc);
      p.epilogue(acc, t % p.tiles_m, t / p.tiles_m);
    }
  } else {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x == 0) {
      uint32_t loads = 0;
      for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x))
        for (int q = 0; q < p.products; ++q) load_tile(sm, loads, product_loads(p, q, t), watch, TaskSite{});
      drain_tile_pipeline(sm, loads, watch);
    }
  }
}

// ---- Host side ------------------------------------------------------------------------------

// The shape of one case: A_q is m x k, each B matrix n x k (batch `batch`, expert `expert` used).
struct GemmShape {
  int64_t m, n, k;
  int products;
  bool pair;
  int kblock0;
  int64_t batch = 1, expert = 0;
  int kblocks = 0;  // k-blocks from kblock0 on; 0: to K's end
};

uint16_t bits_of(float v) { return __nv_bfloat16_raw(__float2bfloat16_rn(v)).x; }
float value_of(uint16_t u) {
  __nv_bfloat16_raw raw;
  raw.x = u;
  return __bfloat162float(__nv_bfloat16(raw));
}

// Random bf16 values in [-range, range] (bits), on the host and the device.
struct HostBf16 {
  std::vector<uint16_t> bits;
  DeviceArray<uint16_t> device;

  HostBf16(int64_t count, float range, std::mt19937_64& rng) : bits(count), device(count) {
    std::uniform_real_distribution<float> dist(-range, range);
    for (auto& v : bits) v = bits_of(dist(rng));
    device.upload(bits, cudaStreamLegacy);
  }
  float operator[](int64_t i) const { return value_of(bits[i]); }
  __nv_bfloat16* data() const { return reinterpret_cast<__nv_bfloat16*>(device.data()); }
};

// A dense operand (rows x k, `batch` of them): K-major at row * k + kk, MN-major at
// kk * rows + row.
struct HostOperand {
  Major major;
  int64_t rows, k;
  HostBf16 values;

  HostOperand(Major mj, int64_t r, int64_t kk, int64_t batch, std::mt19937_64& rng)
      : major(mj), rows(r), k(kk), values(r * kk * batch, 1.f, rng) {}
  float at(int64_t e, int64_t row, int64_t kk) const {
    return values[e * rows * k + (major == Major::K ? row * k + kk : kk * rows + row)];
  }
};

// Outputs the kernel must fill: `count` elements, poisoned before each run, and a tail past
// them that must stay poisoned (NaN bits 0xFFFF for bf16 and fp32 alike).
inline constexpr int64_t kTail = 1024;

template <class T>
struct PoisonedOutput {
  int64_t count;
  DeviceArray<T> device;

  explicit PoisonedOutput(int64_t n) : count(n), device(size_t(n + kTail)) {}
  void poison() { MOKA_CUDA_CHECK(cudaMemset(device.data(), 0xFF, device.bytes())); }
  // The elements; fails the test when the tail was written.
  std::vector<T> read(const char* name) const {
    std::vector<T> all = device.download(cudaStreamLegacy);
    const std::vector<unsigned char> poison(kTail * sizeof(T), 0xFF);
    EXPECT_EQ(std::memcmp(all.data() + count, poison.data(), poison.size()), 0) << name << " written past its end";
    all.resize(count);
    return all;
  }
};

// The operands of one GEMM and the tile loop's launch.
template <Major MA, Major MB>
class CoreGemm {
 public:
  CoreGemm(const GemmShape& s, uint64_t seed) : s_(s), rng_(seed), control_(1) {
    for (int q = 0; q < s.products; ++q) {
      a_.emplace_back(MA, s.m, s.k, 1, rng_);
      for (int h = 0; h < outputs(); ++h) b_.emplace_back(MB, s.n, s.k, s.batch, rng_);
    }
  }

  int outputs() const { return s_.pair ? 2 : 1; }
  int tiles_m() const { return int((s_.m + kTileM - 1) / kTileM); }
  int tiles_n() const { return int((s_.n + (s_.pair ? kHalfN : kTileN) - 1) / (s_.pair ? kHalfN : kTileN)); }
  std::mt19937_64& rng() { return rng_; }
  void set_k_range(int kblock0, int kblocks) {
    s_.kblock0 = kblock0;
    s_.kblocks = kblocks;
  }

  // Runs the tile loop on `ctas` CTAs (fewer than the tiles: each CTA's TMA thread loads the
  // next tile while its consumers finish one, as in the megakernel).
  template <class Epilogue>
  void run(const Epilogue& epilogue, int ctas) {
    CoreGemmParams<MA, MB, Epilogue> p;
    for (int q = 0; q < s_.products; ++q) {
      p.a[q] = make_operand<MA>(a_[q].values.data(), s_.m, s_.k, 1);
      for (int h = 0; h < outputs(); ++h) p.b[q][h] = make_operand<MB>(b(q, h).values.data(), s_.n, s_.k, s_.batch);
    }
    p.products = s_.products;
    p.kblock0 = s_.kblock0;
    p.kblocks = s_.kblocks;
    p.expert = int(s_.expert);
    p.pair = s_.pair;
    p.tiles_m = tiles_m();
    p.tiles_n = tiles_n();
    p.epilogue = epilogue;
    p.control = control_.data();
    p.timeout_ns = 10000000000ull;  // as the megakernel tests: a hang fails fast, compute-sanitizer fits
    MOKA_CUDA_CHECK(cudaMemset(control_.data(), 0, sizeof(MegakernelControl)));
    const int smem = int(sizeof(TileSmem) + 1024);
    auto* kernel = core_gemm_kernel<MA, MB, Epilogue>;
    MOKA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<ctas, kThreads, smem>>>(p);
    MOKA_CUDA_CHECK(cudaGetLastError());
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(int(control_.download(cudaStreamLegacy)[0].status.code), int(core::StatusCode::ok))
        << "the pipeline reported a failure";
  }

  // D(h)(r, c) in fp64 from the bf16 inputs, and the sum of the terms' magnitudes (the scale of
  // fp32 summation error).
  double reference(int h, int64_t r, int64_t c, double& magnitude) const {
    double sum = 0;
    magnitude = 0;
    for (int q = 0; q < s_.products; ++q)
      for (int64_t kk = int64_t(s_.kblock0) * kTileK; kk < k_end(); ++kk) {
        const double t = double(a_[q].at(0, r, kk)) * b(q, h).at(s_.expert, c, kk);
        sum += t;
        magnitude += std::fabs(t);
      }
    return sum;
  }

 private:
  const HostOperand& b(int q, int h) const { return b_[q * outputs() + h]; }
  int64_t k_end() const { return s_.kblocks > 0 ? std::min(s_.k, int64_t(s_.kblock0 + s_.kblocks) * kTileK) : s_.k; }

  GemmShape s_;
  std::mt19937_64 rng_;
  std::vector<HostOperand> a_, b_;
  DeviceArray<MegakernelControl> control_;
};

// fp32 summation slack: far below one misplaced term (about magnitude / K), far above the
// rounding of K <= 400 fp32 additions in any order.
inline constexpr double kSumSlack = 0x1p-14;

// Counts and reports (the first few) elements off their reference.
struct Mismatches {
  const char* what;
  int64_t count = 0;
  void check(bool ok, int64_t r, int64_t c, double got, double want) {
    if (!ok && count++ < 5)
      ADD_FAILURE() << what << " (" << r << ", " << c << "): got " << got << ", expected " << want;
  }
  ~Mismatches() { EXPECT_EQ(count, 0) << what << ": elements off the reference"; }
};

// Checks one plain case: every element within bf16 rounding (plus fp32 summation slack) of
// the fp64 product, nothing written past the outputs, and the same bits from one CTA (every
// tile through one pipeline) and from three. `transposed`: the outputs are stored n x m.
template <Major MA, Major MB>
void check_gemm(const GemmShape& s, bool transposed = false) {
  CoreGemm<MA, MB> gemm(s, 0x5eed0000ull + uint64_t(s.m * 131 + s.n * 7 + s.k));
  ASSERT_GT(gemm.tiles_m() * gemm.tiles_n(), 3) << "the case must give each of three CTAs more than one tile";
  std::vector<PoisonedOutput<uint16_t>> out;
  for (int h = 0; h < gemm.outputs(); ++h) out.emplace_back(s.m * s.n);
  PlainStore store;
  for (int h = 0; h < gemm.outputs(); ++h) store.out[h] = reinterpret_cast<bf16*>(out[h].device.data());
  store.m = s.m;
  store.n = s.n;
  store.pair = s.pair;
  store.transposed = transposed;
  auto run = [&](int ctas) {
    std::vector<std::vector<uint16_t>> bits;
    for (auto& o : out) o.poison();
    gemm.run(store, ctas);
    for (auto& o : out) bits.push_back(o.read("output"));
    return bits;
  };
  const auto one = run(1);
  for (int h = 0; h < gemm.outputs(); ++h) {
    Mismatches bad{h == 0 ? "output 0" : "output 1"};
    for (int64_t r = 0; r < s.m; ++r)
      for (int64_t c = 0; c < s.n; ++c) {
        double magnitude;
        const double want = gemm.reference(h, r, c, magnitude);
        const double got = value_of(one[h][transposed ? c * s.m + r : r * s.n + c]);
        bad.check(std::fabs(got - want) <= std::fabs(want) * 0x1p-8 + magnitude * kSumSlack, r, c, got, want);
      }
  }
  EXPECT_TRUE(run(3) == one) << "bits depend on the CTA count or the run";
}

// The forward's layout (both K-major) through the same harness: the baseline that tells a
// harness fault from an MN-major one; K from k-block 1 on (kblock0 in the contiguous dimension).
TEST(MegakernelBackwardGemm, ForwardLayoutBaseline) {
  check_gemm<Major::K, Major::K>(
      {.m = 200, .n = 264, .k = 320, .products = 1, .pair = false, .kblock0 = 1, .batch = 2, .expert = 1});
}

// dH = d_out . W_down[e]: m = rows (partial last row tile), k = H, n = I = 264 (the last
// 256-column tile's second B box lies wholly past W_down's rows, its first partly).
TEST(MegakernelBackwardGemm, DgdWithMnMajorDownWeights) {
  check_gemm<Major::K, Major::MN>(
      {.m = 200, .n = 264, .k = 320, .products = 1, .pair = false, .kblock0 = 0, .batch = 2, .expert = 1});
}

// d_x = dg . W_gate[e] + du . W_up[e]: one accumulator over both products, K = I = 136 (the
// last k-block of each product partial).
TEST(MegakernelBackwardGemm, DxAccumulatesTwoProducts) {
  check_gemm<Major::K, Major::MN>(
      {.m = 200, .n = 320, .k = 136, .products = 2, .pair = false, .kblock0 = 0, .batch = 2, .expert = 1});
}

// dW_down = d_out^T . h: m = H, n = I, K = 197 rows (not a multiple of the k-block).
TEST(MegakernelBackwardGemm, WeightGradientOverRows) {
  check_gemm<Major::MN, Major::MN>({.m = 320, .n = 264, .k = 197, .products = 1, .pair = false, .kblock0 = 0});
}

// dW_gate^T | dW_up^T = x^T . [dg | du]: two accumulators sharing x, K = rows [64, 197).
TEST(MegakernelBackwardGemm, WeightGradientPairFromInsideTheRows) {
  check_gemm<Major::MN, Major::MN>({.m = 320, .n = 136, .k = 197, .products = 1, .pair = true, .kblock0 = 1});
}

// The same tile stored as dW_gate and dW_up themselves ([I, H]: each half transposed).
TEST(MegakernelBackwardGemm, WeightGradientPairStoredTransposed) {
  check_gemm<Major::MN, Major::MN>({.m = 320, .n = 136, .k = 197, .products = 1, .pair = true, .kblock0 = 0},
                                   /*transposed=*/true);
}

// dW_down over K = 197 rows in two segments, k-blocks [0, 2) and [2, 4): the first leaves its
// fp32 accumulator in a carry buffer, the second continues from it. Bitwise the one-pass
// result (the macrobatch carry of the plan), which itself matches the fp64 product.
TEST(MegakernelBackwardGemm, WeightGradientCarryEqualsOnePass) {
  const GemmShape s{.m = 320, .n = 264, .k = 197, .products = 1, .pair = false, .kblock0 = 0};
  CoreGemm<Major::MN, Major::MN> gemm(s, 0xca770000ull);
  PoisonedOutput<float> whole(s.m * s.n), carry(s.m * s.n), continued(s.m * s.n);
  auto run = [&](PoisonedOutput<float>& out, const float* carry_in, int kblock0, int kblocks, const char* name) {
    out.poison();
    gemm.set_k_range(kblock0, kblocks);
    gemm.run(CarryStore{carry_in, out.device.data(), s.m, s.n}, 3);
    return out.read(name);
  };
  const auto one_pass = run(whole, nullptr, 0, 0, "one pass");
  run(carry, nullptr, 0, 2, "carry");
  const auto two_pass = run(continued, carry.device.data(), 2, 0, "continued");
  EXPECT_EQ(std::memcmp(one_pass.data(), two_pass.data(), one_pass.size() * sizeof(float)), 0)
      << "the carried segments differ from one pass";
  gemm.set_k_range(0, 0);
  Mismatches bad{"one pass"};
  for (int64_t r = 0; r < s.m; ++r)
    for (int64_t c = 0; c < s.n; ++c) {
      double magnitude;
      const double want = gemm.reference(0, r, c, magnitude), got = one_pass[r * s.n + c];
      bad.check(std::fabs(got - want) <= magnitude * kSumSlack + std::fabs(want) * 0x1p-16, r, c, got, want);
    }
}

// The dgd task's GEMM with its SwiGLU-backward epilogue against the same math in fp64 on the
// host (core/activation.hpp, the functions the CPU reference and emulation use): dg, du, hs
// within bf16 rounding of the values the fp64 dH gives (plus the fp32 dH's error carried
// through act'), each row's partial of <dH, h> per 256-column tile, zeros in the last row
// tile's padding rows, same bits from 1 and 3 CTAs.
void check_dgd_epilogue(core::ActParams act) {
  const GemmShape s{.m = 200, .n = 264, .k = 320, .products = 1, .pair = false, .kblock0 = 0, .batch = 2, .expert = 1};
  CoreGemm<Major::K, Major::MN> gemm(s, 0xd9d0000ull + uint64_t(act.clamped));
  const int64_t rows = s.m, I = s.n, col_tiles = gemm.tiles_n();
  // g, u in [-4, 4]: both sides of the clamp (limit 2 below) and of SwiGLU's bend.
  HostBf16 gate(rows * I, 4.f, gemm.rng()), up(rows * I, 4.f, gemm.rng());
  std::vector<float> weight(rows);
  std::uniform_real_distribution<float> w01(0.f, 1.f);
  for (auto& w : weight) w = w01(gemm.rng());
  DeviceArray<float> weight_device(rows);
  weight_device.upload(weight, cudaStreamLegacy);
  // dg, du, hs hold whole row tiles: the padding rows [rows, padded_rows) must come back zero.
  const int64_t padded_rows = int64_t(gemm.tiles_m()) * kTileM;
  PoisonedOutput<uint16_t> dg(padded_rows * I), du(padded_rows * I), hs(padded_rows * I);
  PoisonedOutput<float> partials(rows * col_tiles);
  DgdStore store;
  store.tile = {gate.data(),
                up.data(),
                weight_device.data(),
                reinterpret_cast<__nv_bfloat16*>(dg.device.data()),
                reinterpret_cast<__nv_bfloat16*>(du.device.data()),
                reinterpret_cast<__nv_bfloat16*>(hs.device.data()),
                partials.device.data(),
                0,
                rows,
                0,
                I,
                0,
                col_tiles,
                act};
  auto run = [&](int ctas) {
    for (auto* o : {&dg, &du, &hs}) o->poison();
    partials.poison();
    gemm.run(store, ctas);
    return std::make_tuple(dg.read("dg"), du.read("du"), hs.read("hs"), partials.read("partials"));
  };
  const auto one = run(1);
  const auto& [got_dg, got_du, got_hs, got_partials] = one;
  Mismatches bad_dg{"dg"}, bad_du{"du"}, bad_hs{"hs"}, bad_partial{"partial"}, bad_padding{"padding row"};
  for (int64_t at = rows * I; at < padded_rows * I; ++at)
    for (const auto* got : {&got_dg, &got_du, &got_hs})
      bad_padding.check((*got)[at] == 0, at / I, at % I, value_of((*got)[at]), 0.0);
  const double limit = act.limit;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> partial(col_tiles, 0.0), partial_scale(col_tiles, 0.0);
    for (int64_t c = 0; c < I; ++c) {
      double magnitude;
      const double dh = gemm.reference(0, r, c, magnitude), dh_error = magnitude * kSumSlack;
      const int64_t at = r * I + c;
      const double g = gate[at], u = up[at], w = weight[r];
      // The forward's h: fp32 act of the bf16 g, u, rounded to bf16 (host and device exp may
      // differ in the last fp32 bit: one bf16 step of slack).
      const double h = value_of(bits_of(core::swiglu_forward<float>(float(g), float(u), act.clamped, act.limit)));
      double dg_ref, du_ref, dg_per_dact, du_per_dact;
      core::swiglu_backward<double>(g, u, w * dh, act.clamped, limit, dg_ref, du_ref);
      core::swiglu_backward<double>(g, u, 1.0, act.clamped, limit, dg_per_dact, du_per_dact);
      const double dg_tol = std::fabs(dg_ref) * 0x1p-7 + std::fabs(dg_per_dact) * w * dh_error + 1e-30;
      const double du_tol = std::fabs(du_ref) * 0x1p-7 + std::fabs(du_per_dact) * w * dh_error + 1e-30;
      const double got_g = value_of(got_dg[at]), got_u = value_of(got_du[at]), got_h = value_of(got_hs[at]);
      bad_dg.check(std::fabs(got_g - dg_ref) <= dg_tol, r, c, got_g, dg_ref);
      bad_du.check(std::fabs(got_u - du_ref) <= du_tol, r, c, got_u, du_ref);
      bad_hs.check(std::fabs(got_h - w * h) <= std::fabs(w * h) * 0x1p-6, r, c, got_h, w * h);
      partial[c / kTileN] += dh * h;
      partial_scale[c / kTileN] += std::fabs(dh * h) * 0x1p-8 + dh_error * std::fabs(h);
    }
    for (int64_t t = 0; t < col_tiles; ++t) {
      const double got = got_partials[r * col_tiles + t];
      bad_partial.check(std::fabs(got - partial[t]) <= partial_scale[t], r, t, got, partial[t]);
    }
  }
  EXPECT_TRUE(run(3) == one) << "bits depend on the CTA count or the run";
}

TEST(MegakernelBackwardGemm, DgdEpilogueSwiglu) { check_dgd_epilogue({false, 7.0f}); }
TEST(MegakernelBackwardGemm, DgdEpilogueClampedSwiglu) { check_dgd_epilogue({true, 2.0f}); }

// TMA cannot take an MN-major operand whose rows are not 16-byte multiples, nor a base that is
// not 16-byte aligned: clear errors, before any descriptor is made.
TEST(MegakernelBackwardGemm, MisalignedMnMajorOperandIsRefused) {
  alignas(16) static uint16_t w[128 * 64 + 8];
  auto expect_refused = [](const void* base, int64_t rows, const std::string& named) {
    try {
      (void)make_operand<Major::MN>(base, rows, 64, 1);
      ADD_FAILURE() << "an MN-major operand of " << rows << " rows at " << base << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported_size);
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  };
  expect_refused(w, 100, "contiguous extent 100");
  expect_refused(w + 1, 128, "16-byte aligned base");
}

}  // namespace
}  // namespace moka::cuda::mk
