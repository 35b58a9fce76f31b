#include "cuda/gemm/grouped_gemm.hpp"

#include <algorithm>

#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/gemm/gemm_runner.hpp"

namespace moka::cuda {
namespace {

// Turns the device-side expert counts and segment offsets into this launch's problem sizes and
// pointers (A, B, D, with the SwiGLU epilogue C and aux, with e4m3 operands the scales): one
// thread per group. This is the only place group sizes are read, on the device. A and B hold bf16
// or one-byte e4m3 codes; D, C and aux are bf16.
__global__ void setup_groups(const GroupSpec* specs, int groups, const BufferTable buffers, const int32_t* counts,
                             const int32_t* offsets, GemmOperands operands, GroupArrays out) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const GroupSpec s = specs[g];
  const GroupProblem p = resolve_group(s, counts, offsets);
  const GroupPlacement at = place_group(s, operands, p.row);
  out.problems[3 * g + 0] = static_cast<int>(p.m);
  out.problems[3 * g + 1] = static_cast<int>(p.n);
  out.problems[3 * g + 2] = static_cast<int>(p.k);
  const int ab_bytes = operands == GemmOperands::bf16 ? 2 : 1;
  auto operand = [&](int buffer, int64_t elements) {
    return static_cast<const char*>(buffers.ptr[buffer]) + elements * ab_bytes;
  };
  out.a[g] = operand(s.a, s.a_off + at.ab_steps * s.a_step);
  out.b[g] = operand(s.b, s.b_off + at.ab_steps * s.b_step);
  using bf = unsigned short;                          // pointer arithmetic in bf16 elements
  const int64_t d_elem = s.d_off + p.row * s.d_step;  // C and aux are laid out like D
  out.d[g] = const_cast<bf*>(static_cast<const bf*>(buffers.ptr[s.d])) + d_elem;
  if (out.c) {  // the SwiGLU epilogue: U in, G out
    out.c[g] = static_cast<const bf*>(buffers.ptr[s.c]) + d_elem;
    out.aux[g] = const_cast<bf*>(static_cast<const bf*>(buffers.ptr[s.aux])) + d_elem;
  }
  if (out.sfa) {  // e4m3 operands
    out.sfa[g] = static_cast<const float*>(buffers.ptr[s.sfa]) + at.sfa;
    out.sfb[g] = static_cast<const float*>(buffers.ptr[s.sfb]) + at.sfb;
  }
}

}  // namespace

struct GroupedGemm::Impl {
  GemmLayout layout;
  DeviceArray<GroupSpec> specs;
  // Storage behind `arrays` (c and aux only with the SwiGLU epilogue: null otherwise).
  DeviceArray<int> problems;
  DeviceArray<const void*> a, b, c;
  DeviceArray<void*> d, aux;
  DeviceArray<const float*> sfa, sfb;
  GroupArrays arrays;
  std::unique_ptr<GemmRunner> runner;
  // cublas_loop only
  std::vector<GroupSpec> host_specs;
  cublasHandle_t cublas = nullptr;
  PinnedArray<int32_t> host_counts;  // [2][max expert + 2]: counts, then offsets
  int experts = 0;

  void run_cublas_loop(const BufferTable& buffers, const int32_t* counts, const int32_t* offsets, cudaStream_t stream);
  ~Impl() {
    if (cublas) cublasDestroy(cublas);
  }
};

GroupedGemm::GroupedGemm(const std::vector<GroupSpec>& groups, GemmLayout layout, int device, GemmEngine engine,
                         GemmEpilogue epilogue)
    : impl_(std::make_unique<Impl>()), groups_(groups.size()) {
  require(!groups.empty(), ErrorCode::internal, "grouped GEMM with no groups");
  const bool swiglu = epilogue.kind == GemmEpilogue::swiglu;
  // The baseline stays what users would write: a GEMM loop, then a separate activation pass.
  require(!swiglu || engine == GemmEngine::cutlass, ErrorCode::internal,
          "the SwiGLU epilogue exists in the CUTLASS grouped GEMM only");
  const bool fp8 = layout.operands != GemmOperands::bf16;
  const bool tile_scaled = layout.operands == GemmOperands::e4m3_tile_scaled;
  require(!fp8 || (engine == GemmEngine::cutlass && !swiglu && layout.a == Major::k && layout.b == Major::k &&
                   layout.schedule == GemmSchedule::cooperative),
          ErrorCode::unsupported_size,
          "the e4m3 grouped GEMM is built for K-major A and B, the cooperative schedule, the plain epilogue and the "
          "CUTLASS engine only");
  impl_->layout = layout;
  auto index_ok = [](int i) { return i >= 0 && i < kMaxGemmBuffers; };
  for (const auto& g : groups) {
    require(index_ok(g.a) && index_ok(g.b) && index_ok(g.d) && (!swiglu || (index_ok(g.c) && index_ok(g.aux))),
            ErrorCode::internal, "grouped GEMM buffer index out of range");
    // TMA needs 16-byte aligned rows and bases.
    require(g.lda % 8 == 0 && g.ldb % 8 == 0 && g.ldd % 8 == 0 && g.n % 8 == 0, ErrorCode::unsupported_size,
            "the CUDA backend needs hidden and intermediate sizes that are multiples of 8, got a GEMM with n=" +
                std::to_string(g.n) + " and row pitches " + std::to_string(g.lda) + "/" + std::to_string(g.ldb) + "/" +
                std::to_string(g.ldd));
    // An MN-major operand is read in 16-byte runs along m or n, so that extent must be fixed
    // (never the routed count: its tiles' pointers step along k only) and a multiple of 8.
    require(layout.a == Major::k || (g.count_dim != CountDim::m && g.m % 8 == 0), ErrorCode::unsupported_size,
            "an MN-major A needs a fixed m that is a multiple of 8, got m=" + std::to_string(g.m));
    // e4m3 rows are read in 16-byte runs too (16 codes), from 16-byte aligned group bases: a routed
    // K starts at a transposed column (a multiple of 16) and may end anywhere (TMA fills zeros).
    const CountDim routed = tile_scaled ? CountDim::k : CountDim::m;
    require(!fp8 || (index_ok(g.sfa) && index_ok(g.sfb) && (g.count_dim == CountDim::none || g.count_dim == routed) &&
                     g.lda % 16 == 0 && g.ldb % 16 == 0 && (g.count_dim == CountDim::k || g.k % 16 == 0)),
            ErrorCode::unsupported_size,
            std::string("the e4m3 grouped GEMM needs scale buffers, groups sized along ") +
                (tile_scaled ? "k (tile-scaled operands: the weight gradients)" : "m (block-scaled operands)") +
                " or fixed, and K and row pitches that are multiples of 16, got k=" + std::to_string(g.k) +
                " and pitches " + std::to_string(g.lda) + "/" + std::to_string(g.ldb));
  }
  const size_t G = groups.size();
  if (engine == GemmEngine::cublas_loop) {
    impl_->host_specs = groups;
    for (const auto& g : groups) impl_->experts = std::max(impl_->experts, g.expert + 1);
    impl_->host_counts = PinnedArray<int32_t>(2 * (impl_->experts + 2), PinnedArray<int32_t>::unmapped);
    MOKA_CUBLAS_CHECK(cublasCreate(&impl_->cublas));
    return;
  }
  Impl& im = *impl_;
  im.specs = DeviceArray<GroupSpec>(G);
  im.specs.upload(groups, cudaStreamLegacy);
  im.problems = DeviceArray<int>(G * 3);
  im.a = DeviceArray<const void*>(G);
  im.b = DeviceArray<const void*>(G);
  im.d = DeviceArray<void*>(G);
  if (swiglu) {
    im.c = DeviceArray<const void*>(G);
    im.aux = DeviceArray<void*>(G);
  }
  if (fp8) {
    im.sfa = DeviceArray<const float*>(G);
    im.sfb = DeviceArray<const float*>(G);
  }
  im.arrays = {im.problems.data(), im.a.data(),   im.b.data(),   im.d.data(),
               im.c.data(),        im.aux.data(), im.sfa.data(), im.sfb.data()};
  impl_->runner = make_gemm_runner(impl_->arrays, groups, layout, epilogue, device);
}

GroupedGemm::~GroupedGemm() = default;

void GroupedGemm::Impl::run_cublas_loop(const BufferTable& buffers, const int32_t* counts, const int32_t* offsets,
                                        cudaStream_t stream) {
  int32_t* h_counts = host_counts.host();
  int32_t* h_offsets = h_counts + experts + 2;
  if (experts > 0) {
    // The host-side sizes this baseline needs: a device-to-host copy and a synchronization.
    MOKA_CUDA_CHECK(cudaMemcpyAsync(h_counts, counts, experts * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    MOKA_CUDA_CHECK(cudaMemcpyAsync(h_offsets, offsets, experts * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  MOKA_CUBLAS_CHECK(cublasSetStream(cublas, stream));
  const float one = 1.0f, zero = 0.0f;
  using bf = unsigned short;
  for (const GroupSpec& s : host_specs) {
    int dims[3] = {s.m, s.n, s.k};
    int64_t row = 0;
    if (s.expert >= 0) {
      dims[static_cast<int>(s.count_dim)] = h_counts[s.expert];
      row = h_offsets[s.expert];
      if (h_counts[s.expert] == 0) continue;
    }
    const auto* a = static_cast<const bf*>(buffers.ptr[s.a]) + s.a_off + row * s.a_step;
    const auto* b = static_cast<const bf*>(buffers.ptr[s.b]) + s.b_off + row * s.b_step;
    auto* d = const_cast<bf*>(static_cast<const bf*>(buffers.ptr[s.d])) + s.d_off + row * s.d_step;
    // Row-major D[m, n] is column-major D^T[n, m] = B' A'^T, where B' = [n, k] and A'^T = [k, m]
    // column-major: a K-major B (stored [n, k] row-major = [k, n] column-major) is transposed,
    // an MN-major one ([k, n] row-major = [n, k] column-major) is not; the reverse for A.
    const cublasOperation_t op_b = layout.b == Major::k ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = layout.a == Major::k ? CUBLAS_OP_N : CUBLAS_OP_T;
    MOKA_CUBLAS_CHECK(cublasGemmEx(cublas, op_b, op_a, dims[1], dims[0], dims[2], &one, b, CUDA_R_16BF,
                                   static_cast<int>(s.ldb), a, CUDA_R_16BF, static_cast<int>(s.lda), &zero, d,
                                   CUDA_R_16BF, static_cast<int>(s.ldd), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

void GroupedGemm::run(const BufferTable& buffers, const int32_t* counts, const int32_t* offsets, cudaStream_t stream) {
  if (impl_->cublas) {
    impl_->run_cublas_loop(buffers, counts, offsets, stream);
    return;
  }
  const int G = static_cast<int>(groups_);
  setup_groups<<<(G + 127) / 128, 128, 0, stream>>>(impl_->specs.data(), G, buffers, counts, offsets,
                                                    impl_->layout.operands, impl_->arrays);
  MOKA_CUDA_CHECK_LAUNCH();
  impl_->runner->run(stream);
}

}  // namespace moka::cuda
