// The grouped GEMM in every operand layout the layer uses ({K, K} forward, {K, MN} data
// gradients dY W, {MN, MN} weight gradients dY^T X with K = the expert's rows), through both
// engines (the CUTLASS kernel and the cuBLAS-loop baseline), against a CPU reference of the
// same products: fresh random inputs, poisoned outputs, empty groups, one-row groups (K = 1 for
// the weight gradients), M, N and K that are not multiples of the 128x256x64 tile, segments
// that start on 8-row boundaries only, a fixed-size group in the same launch, and a second call
// with other counts on the same object. Isolates a GEMM fault from the layer's.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>

#include "cuda/device_tensors.hpp"
#include "cuda/grouped_gemm.hpp"
#include "gpu_case.hpp"

using namespace moka;
using namespace moka::cuda;

namespace {

struct LayoutCase {
  const char* name;
  GemmLayout layout;
  CountDim count_dim;  // m: forward and data gradients; k: weight gradients
};

// P and Q are the fixed dimensions (multiples of 8, not of any tile size); kFixedRows is the
// fixed-size group's token count (not a multiple of 8 either, so it may only be m or k).
constexpr int64_t P = 392, Q = 264, kFixedRows = 77, kPad = 8;
enum Slot { kGrouped, kOther, kOut, kFixedA, kFixedB, kFixedOut, kSlots };

// A host buffer of bf16-exact values and its device copy.
struct Operand {
  std::vector<double> host;
  DeviceMemory dev;
  Operand(int64_t n, std::mt19937_64& rng, double stddev) : host(n), dev(n * 2) {
    std::normal_distribution<double> nd(0.0, stddev);
    for (auto& v : host) v = nd(rng);
    gpu_test::round_bf16(host);
    const auto b = gpu_test::to_bf16(host);
    MOKA_CUDA_CHECK(cudaMemcpy(dev.p, b.data(), dev.bytes, cudaMemcpyHostToDevice));
  }
};

using gpu_test::fresh_seed;

// The groups: one per expert, and one fixed-size group (a shared expert's product).
std::vector<GroupSpec> make_groups(const LayoutCase& c, int experts) {
  std::vector<GroupSpec> groups;
  for (int e = 0; e < experts; ++e) {
    GroupSpec g;
    g.expert = e, g.count_dim = c.count_dim;
    g.a = kGrouped, g.a_step = P, g.lda = P;  // [rows, P]: K-major A (k = P) or MN-major A (m = P)
    if (c.count_dim == CountDim::m) {
      g.b = kOther, g.b_off = e * P * Q, g.ldb = c.layout.b == Major::k ? P : Q;  // [Q, P] or [P, Q]
      g.d = kOut, g.d_step = Q, g.ldd = Q;
      g.n = int(Q), g.k = int(P);
    } else {
      g.b = kOther, g.b_step = Q, g.ldb = Q;  // [rows, Q]: MN-major B
      g.d = kOut, g.d_off = e * P * Q, g.ldd = Q;
      g.m = int(P), g.n = int(Q);
    }
    groups.push_back(g);
  }
  GroupSpec f;
  f.a = kFixedA, f.lda = P, f.b = kFixedB, f.ldb = c.layout.b == Major::k ? P : Q, f.d = kFixedOut, f.ldd = Q;
  f.n = int(Q);
  if (c.count_dim == CountDim::m) {
    f.m = int(kFixedRows), f.k = int(P);
  } else {
    f.m = int(P), f.k = int(kFixedRows);
  }
  groups.push_back(f);
  return groups;
}

// Element (i, kk) of a stored operand: K-major [mn, k] or MN-major [k, mn], row pitch ld.
double at(const std::vector<double>& v, int64_t base, Major major, int64_t ld, int64_t i, int64_t kk) {
  return v[base + (major == Major::k ? i * ld + kk : kk * ld + i)];
}

// The reference: every output element a group writes, NaN where nothing may be written (the
// buffers are poisoned, and empty groups and padding rows must stay so).
void reference(const std::vector<GroupSpec>& groups, GemmLayout layout, const std::vector<int32_t>& counts,
               const std::vector<int32_t>& offsets, const std::vector<const std::vector<double>*>& in,
               std::vector<std::vector<double>>& out) {
  for (const GroupSpec& s : groups) {
    int64_t dims[3] = {s.m, s.n, s.k}, row = 0;
    if (s.expert >= 0) {
      if (counts[s.expert] == 0) continue;
      dims[static_cast<int>(s.count_dim)] = counts[s.expert];
      row = offsets[s.expert];
    }
    const int64_t a0 = s.a_off + row * s.a_step, b0 = s.b_off + row * s.b_step, d0 = s.d_off + row * s.d_step;
    for (int64_t i = 0; i < dims[0]; ++i) {
      for (int64_t j = 0; j < dims[1]; ++j) {
        double acc = 0;
        for (int64_t kk = 0; kk < dims[2]; ++kk)
          acc += at(*in[s.a], a0, layout.a, s.lda, i, kk) * at(*in[s.b], b0, layout.b, s.ldb, j, kk);
        out[s.d][d0 + i * s.ldd + j] = acc;
      }
    }
  }
}

// Compares a device output with its reference: written elements within `tol` of max |ref|,
// untouched ones still holding the poison (0xFFFF).
void expect_matches(const DeviceMemory& got_dev, const std::vector<double>& ref, double tol, const char* what) {
  std::vector<uint16_t> bits(ref.size());
  MOKA_CUDA_CHECK(cudaMemcpy(bits.data(), got_dev.p, bits.size() * 2, cudaMemcpyDeviceToHost));
  double diff = 0, scale = 0;
  int64_t written = 0, clobbered = 0, unwritten = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) {
      clobbered += bits[i] != 0xFFFF;
      continue;
    }
    ++written;
    __nv_bfloat16_raw raw;
    raw.x = bits[i];
    const double g = __bfloat162float(__nv_bfloat16(raw));
    if (!std::isfinite(g)) {
      ++unwritten;
      continue;
    }
    diff = std::max(diff, std::abs(g - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  EXPECT_GT(written, 0) << what;
  EXPECT_EQ(unwritten, 0) << what << ": output elements left unwritten (still NaN)";
  EXPECT_EQ(clobbered, 0) << what << ": elements written outside every group's output";
  EXPECT_LE(scale > 0 ? diff / scale : diff, tol) << what << ": max |diff| / max |ref|";
}

class GroupedGemmLayouts : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(GroupedGemmLayouts, MatchCpuReference) {
  const LayoutCase c = GetParam();
  std::mt19937_64 rng(fresh_seed());
  // Two calls on the same GroupedGemm objects: sizes change on the device only.
  const std::vector<std::vector<int32_t>> rounds = {{0, 1, 200, 256, 37, 0, 129, 64}, {64, 129, 0, 37, 256, 200, 1, 0}};
  const int E = int(rounds[0].size());
  int64_t rows = 0;
  for (int32_t n : rounds[0]) rows += (n + kPad - 1) / kPad * kPad;
  const bool by_m = c.count_dim == CountDim::m;
  const std::vector<GroupSpec> groups = make_groups(c, E);
  GroupedGemm cutlass_gemm(groups, c.layout, 0), cublas_gemm(groups, c.layout, 0, GemmEngine::cublas_loop);
  DeviceMemory d_counts(E * 4), d_offsets((E + 1) * 4);
  for (const auto& counts : rounds) {
    std::vector<int32_t> offsets(E + 1, 0);
    for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (counts[e] + kPad - 1) / kPad * kPad;
    MOKA_CUDA_CHECK(cudaMemcpy(d_counts.p, counts.data(), E * 4, cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(d_offsets.p, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
    // Fresh inputs every call: a result left over from the previous call cannot pass.
    Operand grouped(rows * P, rng, 1.0), other(by_m ? E * P * Q : rows * Q, rng, by_m ? 0.05 : 1.0),
        fixed_a(kFixedRows * P, rng, 1.0), fixed_b(by_m ? P * Q : kFixedRows * Q, rng, by_m ? 0.05 : 1.0);
    const int64_t out_elems = by_m ? rows * Q : E * P * Q, fixed_out_elems = by_m ? kFixedRows * Q : P * Q;
    std::vector<std::vector<double>> ref(kSlots);
    ref[kOut].assign(out_elems, NAN);
    ref[kFixedOut].assign(fixed_out_elems, NAN);
    reference(groups, c.layout, counts, offsets,
              {&grouped.host, &other.host, nullptr, &fixed_a.host, &fixed_b.host, nullptr}, ref);
    for (GroupedGemm* gemm : {&cutlass_gemm, &cublas_gemm}) {
      SCOPED_TRACE(std::string(c.name) + (gemm == &cutlass_gemm ? ", CUTLASS" : ", cuBLAS loop") +
                   (&counts == &rounds[0] ? ", first counts" : ", second counts"));
      DeviceMemory out(out_elems * 2), fixed_out(fixed_out_elems * 2);
      MOKA_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.bytes));  // bf16 NaN
      MOKA_CUDA_CHECK(cudaMemset(fixed_out.p, 0xFF, fixed_out.bytes));
      BufferTable t;
      t.ptr[kGrouped] = grouped.dev.p, t.ptr[kOther] = other.dev.p, t.ptr[kOut] = out.p;
      t.ptr[kFixedA] = fixed_a.dev.p, t.ptr[kFixedB] = fixed_b.dev.p, t.ptr[kFixedOut] = fixed_out.p;
      gemm->run(t, d_counts.as<int32_t>(), d_offsets.as<int32_t>(), nullptr);
      MOKA_CUDA_CHECK(cudaDeviceSynchronize());
      expect_matches(out, ref[kOut], 1e-2, "expert groups");
      expect_matches(fixed_out, ref[kFixedOut], 1e-2, "fixed group");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GroupedGemmLayouts,
    ::testing::Values(LayoutCase{"KK_forward", {Major::k, Major::k}, CountDim::m},
                      LayoutCase{"KMN_data_grad", {Major::k, Major::mn}, CountDim::m},
                      LayoutCase{"MNMN_weight_grad", {Major::mn, Major::mn}, CountDim::k}),
    [](const ::testing::TestParamInfo<LayoutCase>& i) { return std::string(i.param.name); });

TEST(GroupedGemmChecks, RejectUnbuiltLayoutAndMisalignedMnMajorExtent) {
  GroupSpec g;
  g.m = 64, g.n = 64, g.k = 64, g.lda = 64, g.ldb = 64, g.ldd = 64;
  EXPECT_THROW(GroupedGemm({g}, GemmLayout{Major::mn, Major::k}, 0), Error);
  g.m = 60;  // an MN-major A is read along m in 16-byte runs
  EXPECT_THROW(GroupedGemm({g}, GemmLayout{Major::mn, Major::mn}, 0), Error);
}

}  // namespace
