// Grouped bf16 GEMMs whose group sizes live in device memory (CUTLASS sm90: TMA loads, wgmma,
// warp-specialized persistent kernels, cooperative or ping-pong: GemmSchedule). The host never
// reads a group size: a small setup kernel turns the device-side expert counts/offsets into
// per-group problem sizes and pointers, then the persistent GEMM walks the groups. Both launches
// are stream-ordered and capturable in a CUDA graph.
//
// Every GEMM is D[m, n] = sum_k A(m, k) B(n, k), fp32 accumulation, bf16 row-major D. Each
// operand is K-major or MN-major (GemmLayout), so the backward products dY W and dY^T X read
// the weights and the routed activations where they are, without transposed copies.
//
// FP8 (GemmOperands::e4m3_*, docs/FP8.md): A and B are e4m3 codes with fp32 scales, A's per
// 1x128 tile of each row, B's per 128x128 block (forward, data gradients) or per 1x128 tile too
// (weight gradients), applied in the promotion of the fp32 accumulator after every 128 of K
// (CUTLASS's blockwise-scaled kernel); K-major A and B only.
//
// The forward gate GEMM can instead end in the SwiGLU epilogue (GemmEpilogue::swiglu,
// swiglu_epilogue.cuh): with acc = sum_k A B and U read from the group's C operand it writes
// G = bf16(acc) to the group's aux output and D = H = act(G, U), the same bits as the plain GEMM
// followed by swiglu_forward_rows, in one pass over the tile.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/activation.hpp"
#include "core/fp8.hpp"
#include "core/hd.hpp"

namespace moka::cuda {

// How an operand is stored, always as a row-major matrix with row pitch lda / ldb:
//   Major::k:  A as [m, k], B as [n, k] (the reduced dimension contiguous), e.g. x W^T;
//   Major::mn: A as [k, m], B as [k, n] (m or n contiguous), e.g. W in dY W, both in dY^T X.
enum class Major : int8_t { k, mn };
// The CUTLASS kernel schedule of one GroupedGemm (gemm_cutlass.cu; the cuBLAS loop ignores it):
//   cooperative: both consumer warpgroups on one 128x256x64 tile (the layer's choice everywhere);
//   pingpong: each consumer warpgroup on its own 128x128x64 tile, the two alternating, so one's
//     epilogue runs under the other's mainloop: for GEMMs with few k-blocks per tile (the weight
//     gradients, short-K products);
//   pingpong_multicast: the same in clusters of two CTAs along m (CUTLASS example 57's grouped
//     ping-pong configuration), which load each B tile once for both (TMA multicast).
// Plain epilogue only for the ping-pong ones. bench/kernels/gemm_schedules checks them against
// the cooperative kernel and times all three on each of the layer's GEMMs.
enum class GemmSchedule : int8_t { cooperative, pingpong, pingpong_multicast };
// What A and B hold: bf16 values, or e4m3 codes with fp32 scales:
//   e4m3_block_scaled: A per 1x128 tile, B per 128x128 block (x W^T, dY W: B is a weight);
//   e4m3_tile_scaled: both per 1x128 tile (dY^T X: both are the K-major copies of activations or
//     gradients, K = an expert's rows; core::transposed_column/block place each expert's part).
// The e4m3 kernels are cooperative on 128x128x128 tiles in 1x2 clusters (B's 128 rows per tile
// are one scale block, or 128 of them); D is bf16 either way.
enum class GemmOperands : int8_t { bf16, e4m3_block_scaled, e4m3_tile_scaled };
// The operand majorness of one GroupedGemm (all its groups), and its kernel schedule.
// Supported: {k, k} (forward), {k, mn} (data gradients dY W), {mn, mn} (weight gradients dY^T X),
// each with every schedule; e4m3 operands: {k, k}, cooperative; block-scaled groups sized along m
// (or fixed), tile-scaled ones along k (or fixed).
struct GemmLayout {
  Major a = Major::k, b = Major::k;
  GemmSchedule schedule = GemmSchedule::cooperative;
  GemmOperands operands = GemmOperands::bf16;
};

// What the epilogue does with a group's fp32 accumulator.
struct GemmEpilogue {
  enum Kind : int8_t {
    plain,   // D = bf16(acc)
    swiglu,  // aux = G = bf16(acc), D = bf16(act(G, C)) (K-major A and B, the cooperative
             // schedule and the CUTLASS engine only)
  };
  Kind kind = plain;
  core::ActParams act;  // swiglu only
};

// Which dimension of a group takes its expert's routed row count.
enum class CountDim : int8_t { none = -1, m = 0, k = 2 };

// Base pointers of one launch, passed by value to the setup kernel, so the caller's tensors
// (weights, x, d_out) may move between calls, and a captured graph keeps the pointers it saw.
inline constexpr int kMaxGemmBuffers = 64;
struct BufferTable {
  const void* ptr[kMaxGemmBuffers] = {};
};

// One group, described once on the host: operands are (buffer index, element offset). For an
// expert group (expert >= 0) the device setup kernel sets the `count_dim` size to that expert's
// row count and advances each operand by expert_offset[expert] * step (the expert's segment of
// a grouped buffer). A group whose count is zero gets m = 0 (no tiles); callers zero such
// outputs themselves where needed. With the SwiGLU epilogue the group also reads C (U) and
// writes aux (G): both are laid out like D (the same offset, step and pitch, in their buffers).
// With e4m3 operands, offsets and steps of A and B count codes (bytes), and the scales are fp32
// in the layouts CUTLASS's sm90 blockwise kernel reads (fp8_quantize.hpp writes them so):
//   A: a group's [ceil(k / 128), m] block (m contiguous), at sfa_off + row * ceil(k / 128), so an
//      expert's block follows the previous experts' blocks in a grouped buffer;
//   B: a group's [ceil(k / 128), ceil(n / 128)] block (n blocks contiguous), at sfb_off.
// Tile-scaled groups sized along k read the K-major copies of quantize_columns_e4m3: A and B
// advance by core::transposed_column(row, expert) steps instead of `row` (their rows are the
// copies' rows, the grouped rows their columns), and the scales are [ceil(k / 128), m] and
// [ceil(k / 128), n] blocks (m, n contiguous) at sfa_off + transposed_block(row, expert) * m and
// sfb_off + transposed_block(row, expert) * n; fixed ones at sfa_off and sfb_off.
struct GroupSpec {
  int a = 0, b = 0, d = 0;                     // BufferTable indices
  int c = -1, aux = -1;                        // SwiGLU epilogue only: BufferTable indices
  int sfa = -1, sfb = -1;                      // e4m3 operands only: BufferTable indices of the scales
  int64_t sfa_off = 0, sfb_off = 0;            // floats
  int64_t a_off = 0, b_off = 0, d_off = 0;     // elements
  int64_t a_step = 0, b_step = 0, d_step = 0;  // elements per grouped row; 0 = fixed
  int64_t lda = 0, ldb = 0, ldd = 0;           // row pitch (elements) of each stored operand
  int m = 0, n = 0, k = 0;
  int expert = -1;
  CountDim count_dim = CountDim::none;
};

// A group's (m, n, k) and first grouped row for one routing (counts, offsets: per expert), as the
// GEMM's setup kernel resolves them: the count dimension takes the expert's rows; an empty expert
// gets m = 0 (no tiles, nor empty-K ones).
struct GroupProblem {
  int64_t m = 0, n = 0, k = 0, row = 0;
};
MOKA_HD GroupProblem resolve_group(const GroupSpec& s, const int32_t* counts, const int32_t* offsets) {
  int64_t dims[3] = {s.m, s.n, s.k};
  int64_t row = 0;
  if (s.expert >= 0) {
    const int32_t count = counts[s.expert];
    row = offsets[s.expert];
    dims[static_cast<int>(s.count_dim)] = count;
    if (count == 0) dims[0] = 0;
  }
  return {dims[0], dims[1], dims[2], row};
}

// Where a group's A and B start for its first grouped row `row` (layouts at GroupSpec), as the
// setup kernel resolves them: the steps A and B advance by (D always advances by `row`), and the
// float offsets of A's and B's scales (e4m3 operands).
struct GroupPlacement {
  int64_t ab_steps = 0, sfa = 0, sfb = 0;
};
MOKA_HD GroupPlacement place_group(const GroupSpec& s, GemmOperands operands, int64_t row) {
  if (operands == GemmOperands::e4m3_tile_scaled && s.count_dim == CountDim::k) {
    const int64_t block = core::transposed_block(row, s.expert);
    return {core::transposed_column(row, s.expert), s.sfa_off + block * s.m, s.sfb_off + block * s.n};
  }
  return {row, s.sfa_off + row * core::fp8_tiles(s.k, core::kFp8TileCols), s.sfb_off};
}

// How the groups run. `cutlass`: the device-sized persistent grouped kernel (the product).
// `cublas_loop`: the comparison baseline users would write without it: copy the counts to the
// host (a synchronization) and issue one cuBLAS GEMM per non-empty group.
enum class GemmEngine { cutlass, cublas_loop };

class GroupedGemm {
 public:
  GroupedGemm(const std::vector<GroupSpec>& groups, GemmLayout layout, int device,
              GemmEngine engine = GemmEngine::cutlass, GemmEpilogue epilogue = {});
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  // counts/offsets: device [E] routed rows and [E + 1] segment starts (may be null when no
  // group is an expert group).
  void run(const BufferTable& buffers, const int32_t* counts, const int32_t* offsets, cudaStream_t stream);
  int groups() const { return static_cast<int>(groups_); }

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  size_t groups_;
};

}  // namespace moka::cuda
