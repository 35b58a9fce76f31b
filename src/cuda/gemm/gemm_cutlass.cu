// The CUTLASS sm90 grouped GEMM (pointer-array, device-side problem sizes): D[m, n] =
// A(m, k) B(n, k) with row-major D and K-major or MN-major operands (GemmLayout), and the
// forward gate GEMM's SwiGLU epilogue (GemmEpilogue::swiglu, swiglu_epilogue.cuh: C = U read per
// group through TMA, D = H, G stored from registers), and the two e4m3 kernels of the FP8 recipe
// (GemmOperands::e4m3_block_scaled and e4m3_tile_scaled, Fp8Parts).
//
// Kernels (GemmSchedule): warp-specialized persistent kernels with one TMA producer warp and two
// consumer warpgroups, 64-deep K blocks and as many pipeline stages as shared memory holds, in
// one of three schedules: cooperative (the two warpgroups share a 128x256 tile: the layer's
// default), ping-pong (each warpgroup takes its own 128x128 tile and the two alternate, one's
// epilogue under the other's mainloop), or ping-pong in 2x1 clusters that multicast B. The
// persistent tile scheduler reads the problem sizes on the device, so the grid is sized from the
// SM count alone and the host never needs the group sizes.
// GemmKernel::operator()(params, smem) is a __device__ function: the megakernel can call the
// same tile loop from its compute CTAs.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <algorithm>
#include <string>

#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/gemm/gemm_runner.hpp"
#include "cuda/gemm/swiglu_epilogue.cuh"

// CUTLASS's sm90 epilogue builder names cute functions (size<1>(...)) unqualified; its own
// examples make them visible this way, and without it g++ misparses the builder.
using namespace cute;

namespace moka::cuda {

// Everything here has internal linkage. The first MN-major attempt compiled one copy of this
// file per layout, each defining the same non-template moka::cuda::GroupedGemmConfig with other
// operand layouts, so CutlassGemmRunner<GroupedGemmConfig> had one mangled name for three
// different classes: an ODR violation. Its inline members and vtable are COMDAT, the linker
// kept the first object's (K-major) copies, and the "MN-major" runners ran the K-major kernel,
// which matched cuBLAS for K-major operands only. Here each layout's and schedule's kernel is a
// distinct type (GemmKK, GemmKMN, GemmMNMN, GemmKKSwiglu, and the ping-pong ones: GemmKKPingpong
// ..., GemmKKPingpongMulticast ...), in an unnamed namespace, so each has its own symbols.
namespace {

// The operands in CUTLASS's terms, where A is (m, k) and B is (n, k) and a layout tag names
// which mode is contiguous: RowMajor A / ColumnMajor B are K-major, the other two MN-major.
template <Major kA>
using LayoutATag = cute::conditional_t<kA == Major::k, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
template <Major kB>
using LayoutBTag = cute::conditional_t<kB == Major::k, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

// What every layout and schedule shares.
struct CommonParts {
  using Element = cutlass::bfloat16_t;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 8;  // 16 bytes of bf16: TMA's alignment
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
};

// The cooperative schedule (GemmSchedule::cooperative), what every layout shares. The epilogue is
// named outside any template: spelled inside a class or function template, nvcc's host pass
// re-emitted its builder's decltype arguments in a form g++ rejects.
struct KernelParts : CommonParts {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element, LayoutD*, kAlign,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  static constexpr int kEpilogueSmem = static_cast<int>(sizeof(typename EpilogueOp::SharedStorage));
};

// The ping-pong schedule (GemmSchedule::pingpong): each consumer warpgroup owns a whole tile, so
// while one runs its epilogue (the store of its tile) the other runs its MMAs; the cooperative
// schedule's two warpgroups finish a tile together and store it together, the tensor cores idle
// meanwhile, which costs most when a tile has few k-blocks (the weight gradients: k = an expert's
// rows, 512 for deepseek-v3 at 16384 tokens). Every type below is CUTLASS's own grouped ping-pong
// configuration (example 57_hopper_grouped_gemm's PingpongConfig and the unit test
// sm90_gemm_f16_f16_f16_tensor_op_f32_group_gemm_pingpong.cu): the PtrArray ping-pong kernel and
// epilogue schedules together (the epilogue's is what gives each warpgroup its own D tensormap),
// a 128x128 tile per warpgroup with 128 bytes of K per block (there 128 fp8 elements or 64 f16,
// here 64 bf16), the builders' automatic epilogue tile (64x32) and stage count after the
// epilogue's shared memory, the default group tile scheduler, and device-side problem sizes with
// no host copy (example 57 runs that way too). One warpgroup's 128x128 fp32 accumulator takes 128
// registers a thread, as a cooperative warpgroup's half of 128x256 does, and a stage (32 KB)
// leaves room for six. The cluster is 1x1x1, as the cooperative kernel's, so a comparison of the
// two measures the schedule alone; PingpongMulticastParts is the 2x1x1 one example 57 uses.
// The epilogue is spelled out again rather than shared through a template (see KernelParts).
struct PingpongParts : CommonParts {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

  using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element, LayoutD*, kAlign,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  static constexpr int kEpilogueSmem = static_cast<int>(sizeof(typename EpilogueOp::SharedStorage));
};

// GemmSchedule::pingpong_multicast: the same in clusters of two CTAs along m, which run
// neighbouring m tiles of one group and n tile, so each B tile is loaded once for both (TMA
// multicast): a quarter less operand traffic per tile than the 1x1x1 kernel, whose 128x128 tiles
// load a third more bytes per MMA than the cooperative 128x256. A group's m tiles are rounded up
// to even (the extra tile is out of bounds: loads read zeros, stores are clipped). The epilogue is
// the 1x1x1 kernel's: CUTLASS 4.2's sm90 TMA epilogue builder takes the cluster shape but builds
// the same collective for any (sm90_builder.inl, "Tma warp-specialized builder").
struct PingpongMulticastParts : CommonParts {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using TileShape = PingpongParts::TileShape;
  using KernelSchedule = PingpongParts::KernelSchedule;
  using EpilogueOp = PingpongParts::EpilogueOp;
};

// The gate GEMM's SwiGLU epilogue (swiglu_epilogue.cuh): the same tile and schedule, plus a
// bf16 C operand (U, one pointer and stride per group, loaded through TMA like D is stored), D =
// H, and G stored by the visitor node. Its shared memory holds the C stages, which D reuses.
struct SwigluParts {
  using P = KernelParts;
  using StrideD = cute::remove_pointer_t<cutlass::detail::TagToStrideC_t<P::LayoutD*>>;  // (pitch, 1, 0)
  using Fusion =
      cutlass::epilogue::fusion::Sm90EVT<SwigluGateStore<StrideD>, cutlass::epilogue::fusion::Sm90SrcFetch<P::Element>>;
  using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, P::TileShape, P::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, P::Element, P::LayoutD*, P::kAlign, P::Element,
      P::LayoutD*, P::kAlign, P::EpilogueSchedule, Fusion>::CollectiveOp;
  static constexpr int kEpilogueSmem = static_cast<int>(sizeof(typename EpilogueOp::SharedStorage));
};

// The e4m3 kernels (GemmOperands::e4m3_*): CUTLASS's sm90 blockwise-scaled pointer-array kernel,
// in the configuration of its grouped example (68_hopper_fp8_warp_specialized_grouped_gemm_with_
// blockwise_scaling): cooperative 128x128x128 tiles (128 e4m3 of K = 128 bytes, one scale per
// k-block), 1x2 clusters multicasting A along n, scales of A per 1x128, of B per 128x128
// (kScaleRowsB = 128: a weight; B's 128 tile rows are one scale block) or per 1x128 (1: the weight
// gradients' K-major activation copies), both MN-major (the layout Sm90BlockwiseScaleConfig
// supports), applied when the accumulator is promoted into fp32 after every k-block. The 128x128
// tile, not 128x256: the promotion keeps a second fp32 accumulator in registers. For the weight
// gradients' few k-blocks per tile, CUTLASS's ping-pong kernel (64x128x128 per warpgroup, 2x1
// clusters) measured 0.74-0.97x this one's TFLOP/s (docs/PERFORMANCE.md). The schedule's parts
// (tile, cluster, epilogue) are built outside the template: g++ fails on CUTLASS's epilogue
// builder, or its shared storage's size, as a dependent type.
struct Fp8CooperativeParts : CommonParts {
  using ElementAB = cutlass::float_e4m3_t;
  static constexpr int kAlignAB = 16;  // 16 bytes of e4m3
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using EpilogueOp = cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element, LayoutD*, kAlign,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  static constexpr int kEpilogueSmem = static_cast<int>(sizeof(EpilogueOp::SharedStorage));
};
template <int kScaleRowsB>
struct Fp8Parts : Fp8CooperativeParts {
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleRowsB, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using MainloopOp = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kAlignAB, ElementAB,
      cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>, KernelSchedule>::CollectiveOp;
};
using Fp8BlockParts = Fp8Parts<128>;
using Fp8TileParts = Fp8Parts<1>;
// What a bf16 runner carries instead of scale layouts.
struct NoScales {
  using LayoutSFA = char;
  using LayoutSFB = char;
};

// The mainloop of one operand layout and schedule (with the shared memory its epilogue leaves
// it): the only part that depends on the layout.
template <Major kA, Major kB, int kEpilogueSmem = KernelParts::kEpilogueSmem, class P = KernelParts>
struct Mainloop {
  using type = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename P::Element, LayoutATag<kA>*, P::kAlign,
      typename P::Element, LayoutBTag<kB>*, P::kAlign, float, typename P::TileShape, typename P::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>, typename P::KernelSchedule>::CollectiveOp;
};

// The kernels: the three layouts of GemmLayout with the plain epilogue in every schedule, and the
// forward layout with the SwiGLU one (cooperative only), and the e4m3 one; spelled outside
// templates (see KernelParts).
template <class MainloopOp, class EpilogueOp = KernelParts::EpilogueOp>
using KernelOf = cutlass::gemm::kernel::GemmUniversal<CommonParts::ProblemShape, MainloopOp, EpilogueOp>;
using GemmKK = cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Mainloop<Major::k, Major::k>::type>>;
using GemmKMN = cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Mainloop<Major::k, Major::mn>::type>>;
using GemmMNMN = cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Mainloop<Major::mn, Major::mn>::type>>;
constexpr int kPingpongSmem = PingpongParts::kEpilogueSmem;
using GemmKKPingpong = cutlass::gemm::device::GemmUniversalAdapter<
    KernelOf<Mainloop<Major::k, Major::k, kPingpongSmem, PingpongParts>::type, PingpongParts::EpilogueOp>>;
using GemmKMNPingpong = cutlass::gemm::device::GemmUniversalAdapter<
    KernelOf<Mainloop<Major::k, Major::mn, kPingpongSmem, PingpongParts>::type, PingpongParts::EpilogueOp>>;
using GemmMNMNPingpong = cutlass::gemm::device::GemmUniversalAdapter<
    KernelOf<Mainloop<Major::mn, Major::mn, kPingpongSmem, PingpongParts>::type, PingpongParts::EpilogueOp>>;
using MulticastParts = PingpongMulticastParts;
using GemmKKPingpongMulticast = cutlass::gemm::device::GemmUniversalAdapter<
    KernelOf<Mainloop<Major::k, Major::k, kPingpongSmem, MulticastParts>::type, MulticastParts::EpilogueOp>>;
using GemmKMNPingpongMulticast = cutlass::gemm::device::GemmUniversalAdapter<
    KernelOf<Mainloop<Major::k, Major::mn, kPingpongSmem, MulticastParts>::type, MulticastParts::EpilogueOp>>;
using GemmMNMNPingpongMulticast = cutlass::gemm::device::GemmUniversalAdapter<
    KernelOf<Mainloop<Major::mn, Major::mn, kPingpongSmem, MulticastParts>::type, MulticastParts::EpilogueOp>>;
// A ping-pong warpgroup's pipeline must hold more than one tile's worth of a short-K GEMM's
// k-blocks in flight for the two warpgroups to overlap; a CUTLASS update that cut the stages
// (a larger epilogue, say) would quietly turn the schedule back into a serial one.
static_assert(Mainloop<Major::mn, Major::mn, kPingpongSmem, PingpongParts>::type::DispatchPolicy::Stages >= 5 &&
                  Mainloop<Major::mn, Major::mn, kPingpongSmem, MulticastParts>::type::DispatchPolicy::Stages >= 5,
              "the ping-pong mainloop has fewer than five pipeline stages");
using GemmKKFp8Blocks =
    cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Fp8BlockParts::MainloopOp, Fp8BlockParts::EpilogueOp>>;
using GemmKKFp8Tiles =
    cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Fp8TileParts::MainloopOp, Fp8TileParts::EpilogueOp>>;
using GemmKKSwiglu = cutlass::gemm::device::GemmUniversalAdapter<
    KernelOf<Mainloop<Major::k, Major::k, SwigluParts::kEpilogueSmem>::type, SwigluParts::EpilogueOp>>;
// The C stages (33 KB of epilogue storage instead of 17 KB) still leave the mainloop its stages;
// if a CUTLASS update changed that, the fused kernel would lose K-pipelining: look again then.
static_assert(Mainloop<Major::k, Major::k, SwigluParts::kEpilogueSmem>::type::DispatchPolicy::Stages ==
                  Mainloop<Major::k, Major::k>::type::DispatchPolicy::Stages,
              "the SwiGLU epilogue's shared memory costs the mainloop a pipeline stage");

// A group's stride: the stored row pitch in the one dynamic mode; the contiguous mode is the
// static unit stride and the batch mode the static 0 (groups are separate pointers). K-major A
// (M, K) = (pitch, 1); MN-major A (M, K) = (1, pitch); likewise B with N; D (M, N) = (pitch, 1).
// The kernel patches each group's TMA descriptor from exactly these strides and its (m, n, k).
template <class Stride>
Stride pitched(int64_t pitch) {
  static_assert(cute::is_static<cute::remove_cvref_t<decltype(cute::get<2>(Stride{}))>>::value,
                "grouped strides have a static batch mode");
  Stride s{};
  if constexpr (cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>, int64_t>) {
    static_assert(cute::is_static<cute::remove_cvref_t<decltype(cute::get<1>(s))>>::value);
    cute::get<0>(s) = pitch;
  } else {
    static_assert(cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<1>(s))>, int64_t>);
    cute::get<1>(s) = pitch;
  }
  return s;
}

// kEpilogue: which epilogue Gemm was built with (its arguments differ); Fp8: the e4m3 kernel's
// parts (its scale layouts), NoScales for bf16.
template <class Gemm, GemmEpilogue::Kind kEpilogue, class Fp8 = NoScales>
class CutlassGemmRunner final : public GemmRunner {
  using Kernel = typename Gemm::GemmKernel;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Element = typename Kernel::ElementA;
  using Shape3 = typename Kernel::ProblemShape::UnderlyingProblemShape;
  using EpilogueArguments = typename Kernel::CollectiveEpilogue::Arguments;
  using MainloopArguments = typename Kernel::CollectiveMainloop::Arguments;
  static constexpr bool kFp8 = !cute::is_same_v<Fp8, NoScales>;

 public:
  CutlassGemmRunner(const GroupArrays& arrays, const std::vector<GroupSpec>& specs, GemmEpilogue epilogue, int device) {
    static_assert(sizeof(Shape3) == 3 * sizeof(int), "problem sizes are written as int[3]");
    const size_t G = specs.size();
    std::vector<StrideA> sa(G);
    std::vector<StrideB> sb(G);
    std::vector<StrideD> sd(G);
    for (size_t g = 0; g < G; ++g) {
      sa[g] = pitched<StrideA>(specs[g].lda);
      sb[g] = pitched<StrideB>(specs[g].ldb);
      sd[g] = pitched<StrideD>(specs[g].ldd);
    }
    strides_a_ = DeviceArray<StrideA>(G);
    strides_b_ = DeviceArray<StrideB>(G);
    strides_d_ = DeviceArray<StrideD>(G);
    strides_a_.upload(sa, cudaStreamLegacy);
    strides_b_.upload(sb, cudaStreamLegacy);
    strides_d_.upload(sd, cudaStreamLegacy);

    cutlass::KernelHardwareInfo hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
    // Host problem shapes are null: the scheduler reads the sizes on the device.
    const typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                        {static_cast<int>(G), reinterpret_cast<Shape3*>(arrays.problems), nullptr},
                                        mainloop_arguments(arrays, specs),
                                        epilogue_arguments(arrays, epilogue),
                                        hw};
    const cutlass::Status ok = gemm_.can_implement(args);
    require(ok == cutlass::Status::kSuccess, ErrorCode::unsupported_size,
            std::string("grouped GEMM cannot take these operands: ") + cutlassGetStatusString(ok));
    const size_t ws = Gemm::get_workspace_size(args);
    if (ws > 0) workspace_ = DeviceArray<std::byte>(ws);
    const cutlass::Status init = gemm_.initialize(args, workspace_.data());
    require(init == cutlass::Status::kSuccess, ErrorCode::cuda,
            std::string("grouped GEMM initialize failed: ") + cutlassGetStatusString(init));
  }

  // The scale layouts are CUTLASS's per-group descriptions; its kernel rebuilds them on the device
  // from each group's (m, n, k) (the host's m of a routed group is a placeholder).
  MainloopArguments mainloop_arguments(const GroupArrays& arrays, const std::vector<GroupSpec>& specs) {
    auto a = reinterpret_cast<const Element**>(arrays.a);
    auto b = reinterpret_cast<const Element**>(arrays.b);
    if constexpr (kFp8) {
      std::vector<typename Fp8::LayoutSFA> la;
      std::vector<typename Fp8::LayoutSFB> lb;
      for (const GroupSpec& g : specs) {
        const auto mnk = cute::make_shape(std::max(g.m, 1), g.n, std::max(g.k, 1), 1);
        la.push_back(Fp8::ScaleConfig::tile_atom_to_shape_SFA(mnk));
        lb.push_back(Fp8::ScaleConfig::tile_atom_to_shape_SFB(mnk));
      }
      layouts_sfa_ = DeviceArray<typename Fp8::LayoutSFA>(la.size());
      layouts_sfb_ = DeviceArray<typename Fp8::LayoutSFB>(lb.size());
      layouts_sfa_.upload(la, cudaStreamLegacy);
      layouts_sfb_.upload(lb, cudaStreamLegacy);
      return {a,          strides_a_.data(),   b,          strides_b_.data(),
              arrays.sfa, layouts_sfa_.data(), arrays.sfb, layouts_sfb_.data()};
    } else {
      return {a, strides_a_.data(), b, strides_b_.data()};
    }
  }

  // C and aux (SwiGLU epilogue) are laid out like D, so D's per-group strides serve all three.
  EpilogueArguments epilogue_arguments(const GroupArrays& arrays, GemmEpilogue epilogue) const {
    EpilogueArguments e{};
    if constexpr (kEpilogue == GemmEpilogue::swiglu) {
      static_assert(cute::is_same_v<StrideD, SwigluParts::StrideD>);
      e.thread = {{},
                  {reinterpret_cast<CommonParts::Element* const*>(arrays.aux), strides_d_.data(), epilogue.act.clamped,
                   epilogue.act.limit}};  // {Sm90SrcFetch's, SwigluGateStore's}
      e.ptr_C = reinterpret_cast<const CommonParts::Element**>(arrays.c);
      e.dC = strides_d_.data();
    } else {
      e.thread.alpha = 1.0f;
      e.thread.beta = 0.0f;
      e.thread.alpha_ptr = nullptr;
      e.thread.beta_ptr = nullptr;
      e.thread.alpha_ptr_array = nullptr;
      e.thread.beta_ptr_array = nullptr;
      e.thread.dAlpha = {cute::_0{}, cute::_0{}, 0};
      e.thread.dBeta = {cute::_0{}, cute::_0{}, 0};
      e.ptr_C = nullptr;
      e.dC = nullptr;
    }
    e.ptr_D = reinterpret_cast<CommonParts::Element**>(arrays.d);
    e.dD = strides_d_.data();
    return e;
  }

  void run(cudaStream_t stream) override {
    const cutlass::Status st = gemm_.run(stream);
    require(st == cutlass::Status::kSuccess, ErrorCode::cuda,
            std::string("grouped GEMM launch failed: ") + cutlassGetStatusString(st));
    MOKA_CUDA_CHECK_LAUNCH();
  }

 private:
  Gemm gemm_;
  DeviceArray<StrideA> strides_a_;
  DeviceArray<StrideB> strides_b_;
  DeviceArray<StrideD> strides_d_;
  DeviceArray<typename Fp8::LayoutSFA> layouts_sfa_;  // e4m3 operands only
  DeviceArray<typename Fp8::LayoutSFB> layouts_sfb_;
  DeviceArray<std::byte> workspace_;  // empty when the kernel needs none
};

// The plain-epilogue runner of one schedule's three layout kernels.
template <class KK, class KMN, class MNMN>
std::unique_ptr<GemmRunner> plain_runner(const GroupArrays& arrays, const std::vector<GroupSpec>& specs,
                                         GemmLayout layout, GemmEpilogue epilogue, int device) {
  constexpr auto plain = GemmEpilogue::plain;
  if (layout.a == Major::k && layout.b == Major::k)
    return std::make_unique<CutlassGemmRunner<KK, plain>>(arrays, specs, epilogue, device);
  if (layout.a == Major::k && layout.b == Major::mn)
    return std::make_unique<CutlassGemmRunner<KMN, plain>>(arrays, specs, epilogue, device);
  if (layout.a == Major::mn && layout.b == Major::mn)
    return std::make_unique<CutlassGemmRunner<MNMN, plain>>(arrays, specs, epilogue, device);
  throw Error(ErrorCode::unsupported_size, "no grouped GEMM kernel is built for an MN-major A with a K-major B");
}

}  // namespace

std::unique_ptr<GemmRunner> make_gemm_runner(const GroupArrays& arrays, const std::vector<GroupSpec>& specs,
                                             GemmLayout layout, GemmEpilogue epilogue, int device) {
  // grouped_gemm.cu checked the e4m3 layouts
  if (layout.operands == GemmOperands::e4m3_block_scaled)
    return std::make_unique<CutlassGemmRunner<GemmKKFp8Blocks, GemmEpilogue::plain, Fp8BlockParts>>(arrays, specs,
                                                                                                    epilogue, device);
  if (layout.operands == GemmOperands::e4m3_tile_scaled)
    return std::make_unique<CutlassGemmRunner<GemmKKFp8Tiles, GemmEpilogue::plain, Fp8TileParts>>(arrays, specs,
                                                                                                  epilogue, device);
  if (epilogue.kind == GemmEpilogue::swiglu) {
    require(layout.a == Major::k && layout.b == Major::k, ErrorCode::unsupported_size,
            "the SwiGLU epilogue is built for K-major A and B (x W^T) only");
    require(layout.schedule == GemmSchedule::cooperative, ErrorCode::unsupported_size,
            "the SwiGLU epilogue is built for the cooperative schedule only");
    return std::make_unique<CutlassGemmRunner<GemmKKSwiglu, GemmEpilogue::swiglu>>(arrays, specs, epilogue, device);
  }
  switch (layout.schedule) {
    case GemmSchedule::cooperative:
      return plain_runner<GemmKK, GemmKMN, GemmMNMN>(arrays, specs, layout, epilogue, device);
    case GemmSchedule::pingpong:
      return plain_runner<GemmKKPingpong, GemmKMNPingpong, GemmMNMNPingpong>(arrays, specs, layout, epilogue, device);
    case GemmSchedule::pingpong_multicast:
      return plain_runner<GemmKKPingpongMulticast, GemmKMNPingpongMulticast, GemmMNMNPingpongMulticast>(arrays, specs,
                                                                                                        layout,
                                                                                                        epilogue,
                                                                                                        device);
  }
  throw Error(ErrorCode::internal, "unknown grouped GEMM schedule");
}

}  // namespace moka::cuda
