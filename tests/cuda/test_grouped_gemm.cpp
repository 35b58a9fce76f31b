// The grouped GEMM in every operand layout the layer uses ({K, K} forward, {K, MN} data
// gradients dY W, {MN, MN} weight gradients dY^T X with K = the expert's rows), through both
// engines (the CUTLASS kernel and the cuBLAS-loop baseline), against a CPU reference of the
// same products: fresh random inputs, poisoned outputs, empty groups, one-row groups (K = 1 for
// the weight gradients), M, N and K that are not multiples of the 128x256x64 tile, segments
// that start on 8-row boundaries only, a fixed-size group in the same launch, and a second call
// with other counts on the same object. Isolates a GEMM fault from the layer's.
// The gate GEMM's SwiGLU epilogue (GemmEpilogue::swiglu) is checked against both the unfused
// path (plain GEMM, then swiglu_forward_rows: the same bits in G and H, every element) and the
// CPU reference, at the named shapes' intermediate widths, with and without the clamp.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>

#include "core/activation.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
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

using gpu_test::DeviceTensor;

// A host buffer of bf16-exact values and its device copy.
struct Operand {
  std::vector<double> host;
  DeviceTensor dev;
  Operand(int64_t n, std::mt19937_64& rng, double stddev) : host(n), dev(n * 2) {
    std::normal_distribution<double> nd(0.0, stddev);
    for (auto& v : host) v = nd(rng);
    gpu_test::round_bf16(host);
    const auto b = gpu_test::to_bf16(host);
    MOKA_CUDA_CHECK(cudaMemcpy(dev.data(), b.data(), dev.bytes(), cudaMemcpyHostToDevice));
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
void expect_matches(const DeviceTensor& got_dev, const std::vector<double>& ref, double tol, const char* what) {
  std::vector<uint16_t> bits(ref.size());
  MOKA_CUDA_CHECK(cudaMemcpy(bits.data(), got_dev.data(), bits.size() * 2, cudaMemcpyDeviceToHost));
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

std::vector<uint16_t> download_bits(const DeviceTensor& d);

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
  DeviceTensor d_counts(E * 4), d_offsets((E + 1) * 4);
  for (const auto& counts : rounds) {
    std::vector<int32_t> offsets(E + 1, 0);
    for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (counts[e] + kPad - 1) / kPad * kPad;
    MOKA_CUDA_CHECK(cudaMemcpy(d_counts.data(), counts.data(), E * 4, cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(d_offsets.data(), offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
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
      DeviceTensor out(out_elems * 2), fixed_out(fixed_out_elems * 2);
      MOKA_CUDA_CHECK(cudaMemset(out.data(), 0xFF, out.bytes()));  // bf16 NaN
      MOKA_CUDA_CHECK(cudaMemset(fixed_out.data(), 0xFF, fixed_out.bytes()));
      BufferTable t;
      t.ptr[kGrouped] = grouped.dev.data(), t.ptr[kOther] = other.dev.data(), t.ptr[kOut] = out.data();
      t.ptr[kFixedA] = fixed_a.dev.data(), t.ptr[kFixedB] = fixed_b.dev.data(), t.ptr[kFixedOut] = fixed_out.data();
      gemm->run(t, d_counts.as<int32_t>(), d_offsets.as<int32_t>(), nullptr);
      MOKA_CUDA_CHECK(cudaDeviceSynchronize());
      expect_matches(out, ref[kOut], 1e-2, "expert groups");
      expect_matches(fixed_out, ref[kFixedOut], 1e-2, "fixed group");
    }
  }
}

// Every layout in every schedule (GemmSchedule); the cooperative cases keep their old names.
constexpr GemmSchedule kPingpong = GemmSchedule::pingpong, kMulticast = GemmSchedule::pingpong_multicast;
const LayoutCase kEveryKernel[] = {
    {"KK_forward", {Major::k, Major::k}, CountDim::m},
    {"KMN_data_grad", {Major::k, Major::mn}, CountDim::m},
    {"MNMN_weight_grad", {Major::mn, Major::mn}, CountDim::k},
    {"KK_forward_pingpong", {Major::k, Major::k, kPingpong}, CountDim::m},
    {"KMN_data_grad_pingpong", {Major::k, Major::mn, kPingpong}, CountDim::m},
    {"MNMN_weight_grad_pingpong", {Major::mn, Major::mn, kPingpong}, CountDim::k},
    {"KK_forward_pingpong_multicast", {Major::k, Major::k, kMulticast}, CountDim::m},
    {"KMN_data_grad_pingpong_multicast", {Major::k, Major::mn, kMulticast}, CountDim::m},
    {"MNMN_weight_grad_pingpong_multicast", {Major::mn, Major::mn, kMulticast}, CountDim::k},
};
std::string case_name(const ::testing::TestParamInfo<LayoutCase>& i) { return i.param.name; }

INSTANTIATE_TEST_SUITE_P(Layouts, GroupedGemmLayouts, ::testing::ValuesIn(kEveryKernel), case_name);

// --- every schedule at a larger size ------------------------------------------------------
//
// Many groups (47 experts and a fixed-size group in one launch): empty experts, one-row ones,
// counts off the 128-row tile and above 2048, K up to 3000 (the weight gradients' K is the
// count), m tiles odd and even (the multicast kernel pairs them), and the same objects called
// again with the counts permuted. Every output element is compared with the cooperative kernel's
// (bit for bit: the inputs are multiples of 1/16 in [-1, 1), so every partial sum is exact in
// fp32 and any accumulation order gives the same accumulator), and a sample of them (every
// group's corners and 4096 random ones) with the exact products on the CPU, rounded to bf16.

// A fixed width of every group (multiples of 8, not of any tile), the K of the m-count layouts,
// and the fixed-size group's token count.
constexpr int64_t kBigM = 776, kBigN = 520, kBigK = 2056, kBigFixedRows = 1000;

// bf16 bits of q / 16 (exact: at most five significant bits).
uint16_t sixteenths(int q) {
  const float f = float(q) / 16.0f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
double bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Random sixteenths on the host (kept for the CPU sample) and on the device.
struct BigOperand {
  std::vector<uint16_t> host;
  DeviceTensor dev;
  BigOperand(int64_t n, std::mt19937_64& rng) : host(n), dev(n * 2) {
    for (auto& v : host) v = sixteenths(int(rng() % 32) - 16);
    dev.upload(host.data());
  }
  double operator()(int64_t i) const { return bf16_value(host[i]); }
};

class GroupedGemmSchedules : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(GroupedGemmSchedules, LargeMatchCooperativeAndCpuSample) {
  const LayoutCase c = GetParam();
  const bool by_m = c.count_dim == CountDim::m;
  std::mt19937_64 rng(fresh_seed());
  constexpr int E = 47;
  // The first experts' counts chosen, the rest random with an empty one in every seven.
  const int32_t chosen[] = {0, 1, 129, 2049, 37, 0, 128, 700, 255, 3000, 8, 513, 384, 385};
  std::vector<int32_t> first(E);
  for (int e = 0; e < E; ++e)
    first[e] = e < int(std::size(chosen)) ? chosen[e] : (e % 7 == 0 ? 0 : int32_t(rng() % 1600));
  std::vector<int32_t> second(first.rbegin(), first.rend());
  int64_t rows = 0;
  for (int32_t n : first) rows += (n + kPad - 1) / kPad * kPad;

  // Slots as the small test's (kGrouped, kOther, kOut, kFixedA, kFixedB, kFixedOut). m-count
  // layouts: A = grouped rows [rows, K], B = the experts' weights ([E][N][K] K-major or
  // [E][K][N] MN-major), D = grouped rows [rows, N]. Weight gradients: A = grouped [rows, M],
  // B = grouped [rows, N] (both MN-major, K = the count), D = [E][M][N].
  const int64_t M = kBigM, N = kBigN, K = kBigK, F = kBigFixedRows;
  std::vector<GroupSpec> groups;
  for (int e = 0; e < E; ++e) {
    GroupSpec g;
    g.expert = e, g.count_dim = c.count_dim, g.n = int(N);
    if (by_m) {
      g.a = kGrouped, g.a_step = K, g.lda = K;
      g.b = kOther, g.b_off = e * N * K, g.ldb = c.layout.b == Major::k ? K : N;
      g.d = kOut, g.d_step = N, g.ldd = N;
      g.k = int(K);
    } else {
      g.a = kGrouped, g.a_step = M, g.lda = M;
      g.b = kOther, g.b_step = N, g.ldb = N;
      g.d = kOut, g.d_off = e * M * N, g.ldd = N;
      g.m = int(M);
    }
    groups.push_back(g);
  }
  GroupSpec f;
  f.a = kFixedA, f.b = kFixedB, f.d = kFixedOut, f.n = int(N), f.ldd = N;
  if (by_m) {
    f.m = int(F), f.k = int(K), f.lda = K, f.ldb = c.layout.b == Major::k ? K : N;
  } else {
    f.m = int(M), f.k = int(F), f.lda = M, f.ldb = N;
  }
  groups.push_back(f);

  const BigOperand grouped(rows * (by_m ? K : M), rng), other(by_m ? E * N * K : rows * N, rng),
      fixed_a(by_m ? F * K : F * M, rng), fixed_b(by_m ? N * K : F * N, rng);
  const int64_t out_elems = by_m ? rows * N : E * M * N, fixed_elems = by_m ? F * N : M * N;
  GemmLayout coop_layout = c.layout;
  coop_layout.schedule = GemmSchedule::cooperative;
  GroupedGemm gemm(groups, c.layout, 0), coop(groups, coop_layout, 0);
  DeviceTensor d_counts(E * 4), d_offsets((E + 1) * 4);
  const std::vector<const BigOperand*> in = {&grouped, &other, nullptr, &fixed_a, &fixed_b, nullptr};

  for (const std::vector<int32_t>* round : {&first, &second}) {
    const std::vector<int32_t>& counts = *round;
    SCOPED_TRACE(std::string(c.name) + (round == &first ? ", first counts" : ", permuted counts"));
    std::vector<int32_t> offsets(E + 1, 0);
    for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (counts[e] + kPad - 1) / kPad * kPad;
    d_counts.upload(counts.data());
    d_offsets.upload(offsets.data());
    // Both kernels' outputs, poisoned (bf16 NaN) first.
    std::vector<std::vector<uint16_t>> got, want;
    for (GroupedGemm* g : {&gemm, &coop}) {
      DeviceTensor out(out_elems * 2), fixed_out(fixed_elems * 2);
      MOKA_CUDA_CHECK(cudaMemset(out.data(), 0xFF, out.bytes()));
      MOKA_CUDA_CHECK(cudaMemset(fixed_out.data(), 0xFF, fixed_out.bytes()));
      BufferTable t;
      t.ptr[kGrouped] = grouped.dev.data(), t.ptr[kOther] = other.dev.data(), t.ptr[kOut] = out.data();
      t.ptr[kFixedA] = fixed_a.dev.data(), t.ptr[kFixedB] = fixed_b.dev.data(), t.ptr[kFixedOut] = fixed_out.data();
      g->run(t, d_counts.as<int32_t>(), d_offsets.as<int32_t>(), nullptr);
      MOKA_CUDA_CHECK(cudaDeviceSynchronize());
      auto& dst = g == &gemm ? got : want;
      dst.push_back(download_bits(out));
      dst.push_back(download_bits(fixed_out));
    }
    // 1. Every element, bit for bit, the cooperative kernel's (unwritten ones: poison in both).
    for (int o = 0; o < 2; ++o) {
      int64_t differ = 0, first_at = -1;
      for (size_t i = 0; i < got[o].size(); ++i)
        if (got[o][i] != want[o][i] && differ++ == 0) first_at = int64_t(i);
      EXPECT_EQ(differ, 0) << (o == 0 ? "expert groups" : "fixed group")
                           << ": elements whose bits differ from the cooperative kernel's; first at " << first_at
                           << " (got 0x" << std::hex << (first_at >= 0 ? got[o][first_at] : 0) << ", cooperative 0x"
                           << (first_at >= 0 ? want[o][first_at] : 0) << std::dec << ")";
    }
    // 2. A sample against the exact products: each non-empty group's four corners and middle,
    //    then random elements of random groups.
    int64_t checked = 0, bad = 0;
    std::string first_bad;
    auto check = [&](size_t gi, int64_t i, int64_t j) {
      const GroupSpec& s = groups[gi];
      int64_t dims[3] = {s.m, s.n, s.k}, row = 0;
      if (s.expert >= 0) dims[static_cast<int>(s.count_dim)] = counts[s.expert], row = offsets[s.expert];
      const int64_t a0 = s.a_off + row * s.a_step, b0 = s.b_off + row * s.b_step, d0 = s.d_off + row * s.d_step;
      double ref = 0;
      for (int64_t kk = 0; kk < dims[2]; ++kk) {
        const int64_t ai = a0 + (c.layout.a == Major::k ? i * s.lda + kk : kk * s.lda + i);
        const int64_t bi = b0 + (c.layout.b == Major::k ? j * s.ldb + kk : kk * s.ldb + j);
        ref += (*in[s.a])(ai) * (*in[s.b])(bi);
      }
      const double g = bf16_value(got[s.d == kOut ? 0 : 1][d0 + i * s.ldd + j]);
      ++checked;
      if (!(std::abs(g - ref) <= std::ldexp(std::abs(ref), -8))) {
        if (bad++ == 0)
          first_bad = "group " + std::to_string(gi) + " (" + std::to_string(i) + ", " + std::to_string(j) +
                      "): " + std::to_string(g) + " vs " + std::to_string(ref);
      }
    };
    std::vector<size_t> nonempty;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const GroupSpec& s = groups[gi];
      if (s.expert >= 0 && counts[s.expert] == 0) continue;
      nonempty.push_back(gi);
      const int64_t m = s.expert >= 0 && s.count_dim == CountDim::m ? counts[s.expert] : s.m;
      for (int64_t i : {int64_t{0}, m / 2, m - 1})
        for (int64_t j : {int64_t{0}, N / 2, N - 1}) check(gi, i, j);
    }
    for (int r = 0; r < 4096; ++r) {
      const size_t gi = nonempty[rng() % nonempty.size()];
      const GroupSpec& s = groups[gi];
      const int64_t m = s.expert >= 0 && s.count_dim == CountDim::m ? counts[s.expert] : s.m;
      check(gi, int64_t(rng() % uint64_t(m)), int64_t(rng() % uint64_t(N)));
    }
    EXPECT_GT(checked, 4096);
    EXPECT_EQ(bad, 0) << "of " << checked << " sampled elements off the exact product by more than a bf16 "
                      << "rounding; first " << first_bad;
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, GroupedGemmSchedules, ::testing::ValuesIn(kEveryKernel), case_name);

// --- the SwiGLU epilogue ------------------------------------------------------------------

struct SwigluCase {
  const char* name;
  int64_t n;     // the routed groups' width (the intermediate size)
  bool clamped;  // the GPT-OSS form, with a limit the products cross often
};

// Routed groups: x_g [rows, P] times W_gate, W_up [E, n, P]; one fixed group (a shared expert:
// kFixedRows rows, width kSharedN, other strides) in the same launches. Fused: D = H, C = U,
// aux = G; unfused: the plain gate product into kGPlain, then the activation into kHPlain.
enum SwigluSlot {
  sX,
  sWG,
  sWU,
  sU,
  sG,
  sH,
  sGPlain,
  sHPlain,
  sXS,
  sWSG,
  sWSU,
  sSU,
  sSG,
  sSH,
  sSGPlain,
  sSHPlain,
  kSwigluSlots
};
constexpr int64_t kSharedN = 520;

// act(G, U) from the device's bf16 G and U, in fp64: each H element must be within one bf16 ulp
// of it (one rounding; the fp32 evaluation adds far less). NaN where G is not written.
std::vector<double> activation_reference(const std::vector<double>& g, const std::vector<double>& u,
                                         core::ActParams act) {
  std::vector<double> h(g.size(), NAN);
  for (size_t i = 0; i < g.size(); ++i)
    if (!std::isnan(g[i])) h[i] = core::swiglu_forward<double>(g[i], u[i], act.clamped, double(act.limit));
  return h;
}

std::vector<uint16_t> download_bits(const DeviceTensor& d) {
  std::vector<uint16_t> b(d.bytes() / 2);
  MOKA_CUDA_CHECK(cudaMemcpy(b.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost));
  return b;
}
std::vector<double> as_double(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    __nv_bfloat16_raw raw;
    raw.x = bits[i];
    v[i] = __bfloat162float(__nv_bfloat16(raw));
  }
  return v;
}

class GroupedGemmSwiglu : public ::testing::TestWithParam<SwigluCase> {};

TEST_P(GroupedGemmSwiglu, EqualsUnfusedBitsAndMatchesCpuReference) {
  const SwigluCase c = GetParam();
  const core::ActParams act{c.clamped, c.clamped ? 0.75f : 7.0f};
  const int64_t N = c.n, NS = kSharedN;
  std::mt19937_64 rng(fresh_seed());
  // Empty experts, one-row experts, counts off the 128-row tile; two calls on the same objects.
  const std::vector<std::vector<int32_t>> rounds = {{0, 1, 200, 256, 37, 0, 129, 64}, {64, 129, 0, 37, 256, 200, 1, 0}};
  const int E = int(rounds[0].size());
  int64_t rows = 0;
  for (int32_t n : rounds[0]) rows += (n + kPad - 1) / kPad * kPad;

  std::vector<GroupSpec> up, gate_plain, gate_fused;
  auto group = [](int e, int a, int64_t k, int b, int d, int64_t n) {
    GroupSpec g;
    g.a = a, g.lda = k, g.b = b, g.ldb = k, g.d = d, g.ldd = n, g.n = int(n), g.k = int(k);
    if (e >= 0) {
      g.a_step = k, g.b_off = e * n * k, g.d_step = n, g.expert = e, g.count_dim = CountDim::m;
    } else {
      g.m = int(kFixedRows);
    }
    return g;
  };
  auto fused = [](GroupSpec g, int c_, int aux, int h) {
    g.c = c_, g.aux = aux, g.d = h;
    return g;
  };
  for (int e = 0; e < E; ++e) {
    up.push_back(group(e, sX, P, sWU, sU, N));
    gate_plain.push_back(group(e, sX, P, sWG, sGPlain, N));
    gate_fused.push_back(fused(group(e, sX, P, sWG, sH, N), sU, sG, sH));
  }
  up.push_back(group(-1, sXS, P, sWSU, sSU, NS));
  gate_plain.push_back(group(-1, sXS, P, sWSG, sSGPlain, NS));
  gate_fused.push_back(fused(group(-1, sXS, P, sWSG, sSH, NS), sSU, sSG, sSH));
  GroupedGemm up_gemm(up, {}, 0), plain_gemm(gate_plain, {}, 0),
      fused_gemm(gate_fused, {}, 0, GemmEngine::cutlass, GemmEpilogue{GemmEpilogue::swiglu, act});
  DeviceTensor d_counts(E * 4), d_offsets((E + 1) * 4);

  for (const auto& counts : rounds) {
    SCOPED_TRACE(std::string(c.name) + (&counts == &rounds[0] ? ", first counts" : ", second counts"));
    std::vector<int32_t> offsets(E + 1, 0), real_rows;
    for (int e = 0; e < E; ++e) {
      offsets[e + 1] = offsets[e] + (counts[e] + kPad - 1) / kPad * kPad;
      for (int32_t r = 0; r < counts[e]; ++r) real_rows.push_back(offsets[e] + r);
    }
    MOKA_CUDA_CHECK(cudaMemcpy(d_counts.data(), counts.data(), E * 4, cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(d_offsets.data(), offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
    DeviceTensor d_rows(real_rows.size() * 4);
    MOKA_CUDA_CHECK(cudaMemcpy(d_rows.data(), real_rows.data(), d_rows.bytes(), cudaMemcpyHostToDevice));
    // Fresh inputs every call; weights ~ 1/sqrt(P), so the products are O(1) and cross the clamp.
    Operand x(rows * P, rng, 1.0), wg(E * N * P, rng, 0.05), wu(E * N * P, rng, 0.05), xs(kFixedRows * P, rng, 1.0),
        wsg(NS * P, rng, 0.05), wsu(NS * P, rng, 0.05);
    std::vector<std::unique_ptr<DeviceTensor>> outs(kSwigluSlots);
    BufferTable t;
    for (int slot : {sU, sG, sH, sGPlain, sHPlain, sSU, sSG, sSH, sSGPlain, sSHPlain}) {
      const bool shared = slot >= sXS;
      outs[slot] = std::make_unique<DeviceTensor>((shared ? kFixedRows * NS : rows * N) * 2);
      MOKA_CUDA_CHECK(cudaMemset(outs[slot]->data(), 0xFF, outs[slot]->bytes()));  // bf16 NaN
      t.ptr[slot] = outs[slot]->data();
    }
    t.ptr[sX] = x.dev.data(), t.ptr[sWG] = wg.dev.data(), t.ptr[sWU] = wu.dev.data();
    t.ptr[sXS] = xs.dev.data(), t.ptr[sWSG] = wsg.dev.data(), t.ptr[sWSU] = wsu.dev.data();
    const auto* cn = d_counts.as<int32_t>();
    const auto* of = d_offsets.as<int32_t>();
    up_gemm.run(t, cn, of, nullptr);
    fused_gemm.run(t, cn, of, nullptr);
    plain_gemm.run(t, cn, of, nullptr);
    auto bf = [&](int slot) { return outs[slot]->as<bf16>(); };
    swiglu_forward_rows(bf(sGPlain), bf(sU), bf(sHPlain), d_rows.as<int32_t>(), int64_t(real_rows.size()), N, act,
                        nullptr);
    swiglu_forward_rows(bf(sSGPlain), bf(sSU), bf(sSHPlain), nullptr, kFixedRows, NS, act, nullptr);
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());

    // 1. The unfused path's bits, every element (unwritten ones must be poison in both).
    struct Pair {
      int fused, plain;
      const char* what;
    };
    for (const Pair& p : {Pair{sG, sGPlain, "G"}, Pair{sH, sHPlain, "H"}, Pair{sSG, sSGPlain, "shared G"},
                          Pair{sSH, sSHPlain, "shared H"}}) {
      const char* what = p.what;
      const auto a = download_bits(*outs[p.fused]), b = download_bits(*outs[p.plain]);
      int64_t differ = 0, first = -1;
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != b[i] && differ++ == 0) first = int64_t(i);
      EXPECT_EQ(differ, 0) << what << ": elements whose bits differ from the unfused path's; first at " << first
                           << " (fused 0x" << std::hex << (first >= 0 ? a[first] : 0) << ", unfused 0x"
                           << (first >= 0 ? b[first] : 0) << std::dec << ")";
    }
    // 2. U and G against the fp64 products (tolerance as in MatchCpuReference); untouched elements
    //    (padding rows, empty experts) still poison.
    std::vector<std::vector<double>> ref(kSwigluSlots);
    ref[sU].assign(rows * N, NAN);
    ref[sH].assign(rows * N, NAN);
    ref[sSU].assign(kFixedRows * NS, NAN);
    ref[sSH].assign(kFixedRows * NS, NAN);
    std::vector<const std::vector<double>*> in(kSwigluSlots, nullptr);
    in[sX] = &x.host, in[sWG] = &wg.host, in[sWU] = &wu.host, in[sXS] = &xs.host, in[sWSG] = &wsg.host,
    in[sWSU] = &wsu.host;
    reference(up, {}, counts, offsets, in, ref);
    reference(gate_fused, {}, counts, offsets, in, ref);  // G lands in the D slots (sH, sSH)
    expect_matches(*outs[sU], ref[sU], 1e-2, "U");
    expect_matches(*outs[sG], ref[sH], 1e-2, "G");
    expect_matches(*outs[sSU], ref[sSU], 1e-2, "shared U");
    expect_matches(*outs[sSG], ref[sSH], 1e-2, "shared G");
    // 3. H = act(G, U) from the device's own G and U: one bf16 rounding per element.
    struct Activation {
      int h, g, u;
      const char* what;
    };
    for (const Activation& o : {Activation{sH, sG, sU, "H"}, Activation{sSH, sSG, sSU, "shared H"}}) {
      const char* what = o.what;
      const std::vector<double> g = as_double(download_bits(*outs[o.g]));
      const std::vector<double> hr = activation_reference(g, as_double(download_bits(*outs[o.u])), act);
      const std::vector<uint16_t> h_bits = download_bits(*outs[o.h]);
      const std::vector<double> h = as_double(h_bits);
      int64_t bad = 0, clobbered = 0, clamped = 0;
      for (size_t i = 0; i < h.size(); ++i) {
        if (std::isnan(hr[i])) {
          clobbered += h_bits[i] != 0xFFFF;
          continue;
        }
        bad += !(std::abs(h[i] - hr[i]) <= std::ldexp(std::abs(hr[i]), -7) + 1e-30);
        clamped += act.clamped && !(g[i] < act.limit);
      }
      EXPECT_EQ(bad, 0) << what << ": elements more than one bf16 ulp from act(G, U)";
      EXPECT_EQ(clobbered, 0) << what << ": elements written outside every group's output";
      if (act.clamped) {
        EXPECT_GT(clamped, 0) << what << ": the clamp was never exercised";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Widths, GroupedGemmSwiglu,
                         ::testing::Values(SwigluCase{"n264", 264, false}, SwigluCase{"n264_clamped", 264, true},
                                           SwigluCase{"qwen3_30b_n768", 768, false},
                                           SwigluCase{"n768_clamped", 768, true}, SwigluCase{"n1408", 1408, false},
                                           SwigluCase{"n1408_clamped", 1408, true}, SwigluCase{"n2880", 2880, false},
                                           SwigluCase{"gpt_oss_n2880_clamped", 2880, true}),
                         [](const ::testing::TestParamInfo<SwigluCase>& i) { return std::string(i.param.name); });

TEST(GroupedGemmChecks, RejectUnbuiltKernelsAndBadOperands) {
  GroupSpec g;
  g.m = 64, g.n = 64, g.k = 64, g.lda = 64, g.ldb = 64, g.ldd = 64;
  EXPECT_THROW(GroupedGemm({g}, GemmLayout{Major::mn, Major::k}, 0), Error);
  g.m = 60;  // an MN-major A is read along m in 16-byte runs
  EXPECT_THROW(GroupedGemm({g}, GemmLayout{Major::mn, Major::mn}, 0), Error);
  // The SwiGLU epilogue: x W^T only, the CUTLASS engine only, and it needs its C and aux buffers.
  g.m = 64, g.c = 1, g.aux = 2;
  const GemmEpilogue swiglu{GemmEpilogue::swiglu, {}};
  EXPECT_THROW(GroupedGemm({g}, GemmLayout{Major::k, Major::mn}, 0, GemmEngine::cutlass, swiglu), Error);
  EXPECT_THROW(GroupedGemm({g}, GemmLayout{}, 0, GemmEngine::cublas_loop, swiglu), Error);
  // ... and the cooperative schedule only.
  for (GemmSchedule s : {kPingpong, kMulticast})
    EXPECT_THROW(GroupedGemm({g}, GemmLayout{Major::k, Major::k, s}, 0, GemmEngine::cutlass, swiglu), Error);
  g.c = -1;
  EXPECT_THROW(GroupedGemm({g}, GemmLayout{}, 0, GemmEngine::cutlass, swiglu), Error);
}

}  // namespace
