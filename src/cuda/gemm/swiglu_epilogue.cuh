// The SwiGLU epilogue of the gate grouped GEMM: a CUTLASS sm90 epilogue-visitor node that turns
// the fp32 accumulator of x W_gate^T into both outputs the layer keeps for backward:
//
//   G = bf16(acc)                                   (stored here, register -> global)
//   H = act(float(G), float(U))                     (returned: the collective stores it as D)
//
// where U, the up projection of the same rows, is the GEMM's C operand (loaded per group by the
// pointer-array TMA epilogue) and act is core::swiglu_forward<float> with the layer's ActParams.
// These are exactly the unfused path's numerics: its plain GEMM rounds the accumulator to bf16
// (G), and swiglu_forward_rows evaluates the same function in fp32 on the bf16 G and U and rounds
// the result to bf16 with round-to-nearest; the collective's conversion of D is the same
// rounding. So G and H are bitwise those of the unfused path (tests/cuda/test_grouped_gemm.cpp).
//
// Why a node of our own: the second output (G) needs a per-group pointer and stride, and
// CUTLASS 4.2's Sm90AuxStore is not pointer-array aware (its pointer and stride are one batched
// tensor). This node is Sm90AuxStore<0>'s register-to-global path (no shared memory, predicated
// vector stores of the thread's accumulator fragments), with the tensor picked by the group
// index, which the pointer-array kernel passes as the l of tile_coord_mnkl. The setup kernel in
// grouped_gemm.cu writes the per-group G pointers; the strides are fixed per group on the host.
// Used as the root of Sm90EVT<SwigluGateStore, Sm90SrcFetch<bf16>> (gemm_cutlass.cu).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include "core/activation.hpp"

namespace moka::cuda {

// StrideG: a group's (M, N, L) stride of G, the same type as the kernel's D stride.
template <class StrideG>
struct SwigluGateStore {
  using ElementG = cutlass::bfloat16_t;

  struct SharedStorage {};
  struct Arguments {
    ElementG* const* ptr_g = nullptr;  // [groups] device array: each group's G
    StrideG const* d_g = nullptr;      // [groups] device array
    bool clamped = false;              // core::swiglu_forward's clamped form (GPT-OSS)
    float limit = 7.0f;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE SwigluGateStore() {}
  CUTLASS_HOST_DEVICE SwigluGateStore(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  // C is requested by the Sm90SrcFetch child; this node loads nothing itself.
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class GTensor, class RTensor, class CTensor, class ProblemShapeMNL>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor&& gG, RTensor&& rG, CTensor&& cG, ProblemShapeMNL shape,
                                          Params const* params)
        : tC_gG(cute::forward<GTensor>(gG)), tC_rG(cute::forward<RTensor>(rG)), tC_cG(cute::forward<CTensor>(cG)),
          problem_shape_mnl(shape), params(params) {}

    GTensor tC_gG;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): this thread's G elements of the tile
    RTensor tC_rG;  // (CPY, CPY_M, CPY_N): the current epilogue subtile's G, in registers
    CTensor tC_cG;  // coordinates of tC_gG, for the residue predicate
    ProblemShapeMNL problem_shape_mnl;
    Params const* params;

    // frg_c: U as the collective loaded it (bf16 or already fp32: either converts exactly).
    template <typename ElementAccumulator, typename ElementC, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int, int,
        cutlass::Array<ElementC, FragmentSize> const& frg_c) {
      using namespace cute;
      cutlass::Array<ElementG, FragmentSize> g;
      cutlass::Array<float, FragmentSize> h;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        // + 0: the plain epilogue computes 1 * acc + 0 * C, which turns an exact -0 into +0.
        g[i] = ElementG(static_cast<float>(frg_acc[i]) + 0.0f);  // round to nearest even
        h[i] = core::swiglu_forward<float>(static_cast<float>(g[i]), static_cast<float>(frg_c[i]), params->clamped,
                                           params->limit);
      }
      Tensor tC_rG_frg = recast<cutlass::Array<ElementG, FragmentSize>>(coalesce(tC_rG));
      tC_rG_frg(epi_v) = g;
      return h;
    }

    // After each epilogue subtile: its G fragments to global memory, rows and columns past the
    // group's (m, n) masked (the same vectorized predicated copy as Sm90AuxStore<0>).
    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      using namespace cute;
      constexpr auto MCL = decltype(max_common_layout(tC_gG(_, _, _, _0{}, _0{}), tC_rG)){};
      constexpr int V = cute::min(8, size(MCL));  // at most 16 bytes of bf16
      Tensor tC_gG_vec = recast<cutlass::Array<ElementG, V>>(coalesce(tC_gG(_, _, _, epi_m, epi_n)));
      Tensor tC_rG_vec = recast<cutlass::Array<ElementG, V>>(coalesce(tC_rG));
      Tensor tC_cG_vec = tensor<1>(zipped_divide(coalesce(tC_cG(_, _, _, epi_m, epi_n)), MCL.compose(Int<V>{})));
      Tensor tC_pG_vec =
          cute::lazy::transform(tC_cG_vec, [&](auto const& c) { return elem_less(c, problem_shape_mnl); });
      copy_if(tC_pG_vec, tC_rG_vec, tC_gG_vec);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, group] = args.tile_coord_mnkl;  // the pointer-array kernel's l is the group
    // This group's G as an (M, N, 1) tensor; the tile coordinate's l is then 0.
    auto problem_shape_mnl = make_shape(M, N, _1{});
    Tensor mG = make_tensor(make_gmem_ptr(params_ptr->ptr_g[group]), problem_shape_mnl, params_ptr->d_g[group]);
    auto tile_coord = make_coord(m, n, k, _0{});
    Tensor tC_gG =
        cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue<ReferenceSrc>(mG, args.tile_shape_mnk,
                                                                                     tile_coord, args.epi_tile,
                                                                                     args.tiled_copy, args.thread_idx);
    Tensor tC_rG = make_tensor<ElementG>(take<0, 3>(shape(tC_gG)));
    Tensor tC_cG = cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(problem_shape_mnl), args.tile_shape_mnk, tile_coord, args.epi_tile, args.tiled_copy,
        args.thread_idx);
    return ConsumerStoreCallbacks<decltype(tC_gG), decltype(tC_rG), decltype(tC_cG), decltype(problem_shape_mnl)>(
        cute::move(tC_gG), cute::move(tC_rG), cute::move(tC_cG), problem_shape_mnl, params_ptr);
  }
};

}  // namespace moka::cuda
