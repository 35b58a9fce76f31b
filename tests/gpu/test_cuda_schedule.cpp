// The device routing schedule equals core::build_receive_schedule: counts, padded offsets and
// the row of every slot, for uniform, skewed and single-expert routing and several tile sizes.
#include <gtest/gtest.h>

#include "core/routing_gen.hpp"
#include "core/schedule.hpp"
#include "cuda/check.hpp"
#include "cuda/layer_kernels.hpp"
#include "gpu_case.hpp"

using namespace moka;

class DeviceSchedule : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, core::RoutingKind>> {};

TEST_P(DeviceSchedule, EqualsTheCpuSchedule) {
  const auto [T, E, tile, kind] = GetParam();
  const int64_t k = std::min<int64_t>(4, E);
  const auto ids = core::sample_topk_ids({kind, 0.6, uint64_t(T * 131 + E)}, T, k, E);
  const auto ref = core::build_receive_schedule({1, T, k, E, 0, tile}, ids.data());

  const int64_t slots = T * k;
  gpu_test::DeviceTensor d_ids(slots * 4), d_w(slots * 4), chunk(cuda::schedule_chunks(slots) * E * 4),
      counts(E * 4), offsets((E + 1) * 4), rows(slots * 4);
  std::vector<float> w(slots, 0.5f);
  MOKA_CUDA_CHECK(cudaMemcpy(d_ids.ptr, ids.data(), slots * 4, cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(d_w.ptr, w.data(), slots * 4, cudaMemcpyHostToDevice));
  unsigned long long* err = nullptr;
  MOKA_CUDA_CHECK(cudaHostAlloc(&err, sizeof(*err), cudaHostAllocMapped));
  *err = ~0ull;
  unsigned long long* dev_err = nullptr;
  MOKA_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_err), err, 0));
  cuda::DeviceSchedule s;
  s.slots = slots, s.num_experts = E, s.global_experts = E, s.tile_rows = tile, s.top_k = k;
  s.chunk_counts = static_cast<int32_t*>(chunk.ptr);
  s.counts = static_cast<int32_t*>(counts.ptr);
  s.offsets = static_cast<int32_t*>(offsets.ptr);
  s.row_of_slot = static_cast<int32_t*>(rows.ptr);
  s.error = dev_err;
  cuda::build_schedule(s, static_cast<int32_t*>(d_ids.ptr), static_cast<float*>(d_w.ptr), nullptr);
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(*err, ~0ull);
  cudaFreeHost(err);

  std::vector<int32_t> hc(E), ho(E + 1), hr(slots);
  MOKA_CUDA_CHECK(cudaMemcpy(hc.data(), counts.ptr, E * 4, cudaMemcpyDeviceToHost));
  MOKA_CUDA_CHECK(cudaMemcpy(ho.data(), offsets.ptr, (E + 1) * 4, cudaMemcpyDeviceToHost));
  MOKA_CUDA_CHECK(cudaMemcpy(hr.data(), rows.ptr, slots * 4, cudaMemcpyDeviceToHost));
  for (int64_t e = 0; e < E; ++e) {
    ASSERT_EQ(hc[e], ref.expert_rows[e]) << "expert " << e;
    ASSERT_EQ(ho[e], ref.expert_offset[e]) << "expert " << e;
  }
  ASSERT_EQ(ho[E], ref.total_rows());
  std::vector<int64_t> row_slot(ref.total_rows(), -1);
  for (int64_t sl = 0; sl < slots; ++sl) row_slot.at(hr[sl]) = sl;
  EXPECT_EQ(row_slot, ref.row_slot);
}

INSTANTIATE_TEST_SUITE_P(Routing, DeviceSchedule,
                         ::testing::Combine(::testing::Values<int64_t>(1, 37, 300, 4096),
                                            ::testing::Values<int64_t>(8, 128, 384), ::testing::Values<int64_t>(1, 128),
                                            ::testing::Values(core::RoutingKind::uniform, core::RoutingKind::zipf,
                                                              core::RoutingKind::one_expert)));
