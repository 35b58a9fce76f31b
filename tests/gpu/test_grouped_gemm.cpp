// The grouped GEMM against the per-group cuBLAS loop on the same operands, with empty, one-row,
// tile-crossing and tile-aligned groups, with the expert's rows as m (forward and data
// gradients) and as k (weight gradients): isolates a GEMM fault from the layer's.
#include <gtest/gtest.h>

#include "cpu/compare.hpp"
#include "cuda/device_tensors.hpp"
#include "cuda/grouped_gemm.hpp"

using namespace moka;
using namespace moka::cuda;

namespace {

std::vector<double> read(const DeviceMemory& m) {
  std::vector<__nv_bfloat16> b(m.bytes / 2);
  MOKA_CUDA_CHECK(cudaMemcpy(b.data(), m.p, m.bytes, cudaMemcpyDeviceToHost));
  return std::vector<double>(b.begin(), b.end());
}

class GroupedGemmCounts : public ::testing::TestWithParam<CountDim> {};

TEST_P(GroupedGemmCounts, MatchCublasLoop) {
  const CountDim count_dim = GetParam();
  const std::vector<int32_t> counts = {0, 1, 200, 256, 37};
  const int E = int(counts.size());
  std::vector<int32_t> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (counts[e] + 127) / 128 * 128;
  const int64_t rows = offsets[E], P = 384, Q = 264;  // P: the fixed dimension, Q: the other
  DeviceMemory d_counts(E * 4), d_offsets((E + 1) * 4);
  MOKA_CUDA_CHECK(cudaMemcpy(d_counts.p, counts.data(), E * 4, cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(d_offsets.p, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  // Grouped operands [rows, P] / [P, rows]; per-expert weights [E, Q, P]; output sized for both.
  DeviceMemory grouped(rows * P * 2), grouped2(rows * Q * 2), weights(E * P * Q * 2), out(std::max(rows * Q, E * P * Q) * 2),
      out_ref(out.bytes);
  grouped.fill_normal(1.0, 1);
  grouped2.fill_normal(1.0, 2);
  weights.fill_normal(0.05, 3);
  std::vector<GroupSpec> groups;
  for (int e = 0; e < E; ++e) {
    GroupSpec g;
    if (count_dim == CountDim::m) {  // [m, P] x [Q, P]^T -> [m, Q]
      g.a = 0, g.a_step = P, g.lda = P, g.b = 1, g.b_off = e * Q * P, g.ldb = P, g.d = 2, g.d_step = Q, g.ldd = Q;
      g.n = int(Q), g.k = int(P);
    } else {  // [P, k] x [Q, k]^T -> [P, Q] per expert, k = the expert's rows (columns here)
      g.a = 0, g.a_step = 1, g.lda = rows, g.b = 3, g.b_step = 1, g.ldb = rows, g.d = 2, g.d_off = e * P * Q;
      g.ldd = Q, g.m = int(P), g.n = int(Q);
    }
    g.count_dim = count_dim;
    g.expert = e;
    groups.push_back(g);
  }
  BufferTable t;
  t.ptr[0] = grouped.p, t.ptr[1] = weights.p, t.ptr[3] = grouped2.p;
  MOKA_CUDA_CHECK(cudaMemset(out.p, 0, out.bytes));
  MOKA_CUDA_CHECK(cudaMemset(out_ref.p, 0, out_ref.bytes));
  t.ptr[2] = out.p;
  GroupedGemm(groups, 0).run(t, d_counts.as<int32_t>(), d_offsets.as<int32_t>(), nullptr);
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  t.ptr[2] = out_ref.p;
  GroupedGemm(groups, 0, GemmEngine::cublas_loop).run(t, d_counts.as<int32_t>(), d_offsets.as<int32_t>(), nullptr);
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_LE(cpu::max_rel_error(read(out), read(out_ref)), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(All, GroupedGemmCounts, ::testing::Values(CountDim::m, CountDim::k));

}  // namespace
