// The CUTLASS sm90 grouped GEMM (pointer-array, device-side problem sizes): D[m, n] =
// A(m, k) B(n, k) with row-major D and K-major or MN-major operands (GemmLayout), and the
// forward gate GEMM's SwiGLU epilogue (GemmEpilogue::swiglu, swiglu_epilogue.cuh: C = U read per
// group through TMA, D = H, G stored from registers).
//
// Kernel: warp-specialized cooperative persistent kernel (one TMA producer warp, two consumer
// warpgroups sharing a 128x256 tile, 64-deep K blocks, as many pipeline stages as shared
// memory holds). The persistent tile scheduler reads the problem sizes on the device, so the
// grid is sized from the SM count alone and the host never needs the group sizes.
// GemmKernel::operator()(params, smem) is a __device__ function: the megakernel can call the
// same tile loop from its compute CTAs.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

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
// which matched cuBLAS for K-major operands only. Here each layout's kernel is a distinct
// type (GemmKK, GemmKMN, GemmMNMN, GemmKKSwiglu), in an unnamed namespace, so each has its own
// symbols.
namespace {

// The operands in CUTLASS's terms, where A is (m, k) and B is (n, k) and a layout tag names
// which mode is contiguous: RowMajor A / ColumnMajor B are K-major, the other two MN-major.
template <Major kA>
using LayoutATag = cute::conditional_t<kA == Major::k, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
template <Major kB>
using LayoutBTag = cute::conditional_t<kB == Major::k, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

// What every layout shares. The epilogue is named outside any template: spelled inside a class
// or function template, nvcc's host pass re-emitted its builder's decltype arguments in a form
// g++ rejects.
struct KernelParts {
  using Element = cutlass::bfloat16_t;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 8;  // 16 bytes of bf16: TMA's alignment
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element, LayoutD*, kAlign,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  static constexpr int kEpilogueSmem = static_cast<int>(sizeof(typename EpilogueOp::SharedStorage));
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

// The mainloop of one operand layout (with the shared memory its epilogue leaves it): the only
// part that depends on the layout.
template <Major kA, Major kB, int kEpilogueSmem = KernelParts::kEpilogueSmem>
struct Mainloop {
  using P = KernelParts;
  using type = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, P::Element, LayoutATag<kA>*, P::kAlign, P::Element,
      LayoutBTag<kB>*, P::kAlign, float, P::TileShape, P::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>, P::KernelSchedule>::CollectiveOp;
};

// The kernels: the three layouts of GemmLayout with the plain epilogue, and the forward layout
// with the SwiGLU one; spelled outside templates (see KernelParts).
template <class MainloopOp, class EpilogueOp = KernelParts::EpilogueOp>
using KernelOf = cutlass::gemm::kernel::GemmUniversal<KernelParts::ProblemShape, MainloopOp, EpilogueOp>;
using GemmKK = cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Mainloop<Major::k, Major::k>::type>>;
using GemmKMN = cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Mainloop<Major::k, Major::mn>::type>>;
using GemmMNMN = cutlass::gemm::device::GemmUniversalAdapter<KernelOf<Mainloop<Major::mn, Major::mn>::type>>;
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

// kEpilogue: which epilogue Gemm was built with (its arguments differ).
template <class Gemm, GemmEpilogue::Kind kEpilogue>
class CutlassGemmRunner final : public GemmRunner {
  using Kernel = typename Gemm::GemmKernel;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Element = typename Kernel::ElementA;
  using Shape3 = typename Kernel::ProblemShape::UnderlyingProblemShape;
  using EpilogueArguments = typename Kernel::CollectiveEpilogue::Arguments;

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
                                        {reinterpret_cast<const Element**>(arrays.a), strides_a_.data(),
                                         reinterpret_cast<const Element**>(arrays.b), strides_b_.data()},
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

  // C and aux (SwiGLU epilogue) are laid out like D, so D's per-group strides serve all three.
  EpilogueArguments epilogue_arguments(const GroupArrays& arrays, GemmEpilogue epilogue) const {
    EpilogueArguments e{};
    if constexpr (kEpilogue == GemmEpilogue::swiglu) {
      static_assert(cute::is_same_v<StrideD, SwigluParts::StrideD>);
      e.thread = {{},
                  {reinterpret_cast<Element* const*>(arrays.aux), strides_d_.data(), epilogue.act.clamped,
                   epilogue.act.limit}};  // {Sm90SrcFetch's, SwigluGateStore's}
      e.ptr_C = reinterpret_cast<const Element**>(arrays.c);
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
    e.ptr_D = reinterpret_cast<Element**>(arrays.d);
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
  DeviceArray<std::byte> workspace_;  // empty when the kernel needs none
};

}  // namespace

std::unique_ptr<GemmRunner> make_gemm_runner(const GroupArrays& arrays, const std::vector<GroupSpec>& specs,
                                             GemmLayout layout, GemmEpilogue epilogue, int device) {
  const bool kk = layout.a == Major::k && layout.b == Major::k;
  if (epilogue.kind == GemmEpilogue::swiglu) {
    require(kk, ErrorCode::unsupported_size, "the SwiGLU epilogue is built for K-major A and B (x W^T) only");
    return std::make_unique<CutlassGemmRunner<GemmKKSwiglu, GemmEpilogue::swiglu>>(arrays, specs, epilogue, device);
  }
  constexpr auto plain = GemmEpilogue::plain;
  if (kk) return std::make_unique<CutlassGemmRunner<GemmKK, plain>>(arrays, specs, epilogue, device);
  if (layout.a == Major::k && layout.b == Major::mn)
    return std::make_unique<CutlassGemmRunner<GemmKMN, plain>>(arrays, specs, epilogue, device);
  if (layout.a == Major::mn && layout.b == Major::mn)
    return std::make_unique<CutlassGemmRunner<GemmMNMN, plain>>(arrays, specs, epilogue, device);
  throw Error(ErrorCode::unsupported_size, "no grouped GEMM kernel is built for an MN-major A with a K-major B");
}

}  // namespace moka::cuda
