// The device routing schedule equals core::build_receive_schedule: counts, padded offsets and
// the row of every slot, for uniform, skewed and single-expert routing and several tile sizes;
// and the gather that follows it moves every routed row.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "core/routing_gen.hpp"
#include "core/schedule.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "gpu_case.hpp"

using namespace moka;

class DeviceSchedule : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, core::RoutingKind>> {};

TEST_P(DeviceSchedule, EqualsTheCpuSchedule) {
  const auto [T, E, tile, kind] = GetParam();
  const int64_t k = std::min<int64_t>(4, E);
  const auto ids = core::sample_topk_ids({kind, 0.6, uint64_t(T * 131 + E)}, T, k, E);
  const auto ref = core::build_receive_schedule({1, T, k, E, 0, tile}, ids.data());

  const int64_t slots = T * k;
  gpu_test::DeviceTensor d_ids(slots * 4), d_w(slots * 4), chunk(cuda::schedule_chunks(slots) * E * 4), counts(E * 4),
      offsets((E + 1) * 4), rows(slots * 4);
  std::vector<float> w(slots, 0.5f);
  MOKA_CUDA_CHECK(cudaMemcpy(d_ids.data(), ids.data(), slots * 4, cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(d_w.data(), w.data(), slots * 4, cudaMemcpyHostToDevice));
  cuda::PinnedWord<unsigned long long> err(cuda::kNoRoutingError);
  cuda::DeviceSchedule s;
  s.slots = slots, s.num_experts = E, s.global_experts = E, s.tile_rows = tile, s.top_k = k;
  s.chunk_counts = chunk.as<int32_t>();
  s.counts = counts.as<int32_t>();
  s.offsets = offsets.as<int32_t>();
  s.row_of_slot = rows.as<int32_t>();
  s.error = err.device();
  cuda::build_schedule(s, d_ids.as<int32_t>(), d_w.as<float>(), nullptr);
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(err.load(), cuda::kNoRoutingError);

  std::vector<int32_t> hc(E), ho(E + 1), hr(slots);
  MOKA_CUDA_CHECK(cudaMemcpy(hc.data(), counts.data(), E * 4, cudaMemcpyDeviceToHost));
  MOKA_CUDA_CHECK(cudaMemcpy(ho.data(), offsets.data(), (E + 1) * 4, cudaMemcpyDeviceToHost));
  MOKA_CUDA_CHECK(cudaMemcpy(hr.data(), rows.data(), slots * 4, cudaMemcpyDeviceToHost));
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

// Across ranks: the receive schedule from every source's ids ([R][T*k], as the megakernel's
// routing exchange leaves them) equals the CPU rule for either row order.
class DeviceScheduleAcrossRanks
    : public ::testing::TestWithParam<std::tuple<int, int64_t, core::RoutingKind, RowOrder>> {};

TEST_P(DeviceScheduleAcrossRanks, EqualsTheCpuSchedule) {
  const auto [R, T, kind, order] = GetParam();
  const int64_t k = 4, El = 16, E = El * R, tile = 128, slots = T * k;
  std::vector<int32_t> all;
  for (int r = 0; r < R; ++r) {
    const auto ids = core::sample_topk_ids({kind, 0.5, uint64_t(T + R)}, T, k, E, r);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  for (int rank : {0, R - 1}) {
    const auto ref = core::build_receive_schedule({R, T, k, El, rank * El, tile, order, rank}, all.data());
    gpu_test::DeviceTensor d_ids(R * slots * 4), chunk(cuda::schedule_chunks(R * slots) * El * R * 4), counts(El * 4),
        source_counts(El * R * 4), offsets((El + 1) * 4), rows(R * slots * 4);
    MOKA_CUDA_CHECK(cudaMemcpy(d_ids.data(), all.data(), R * slots * 4, cudaMemcpyHostToDevice));
    cuda::DeviceSchedule s;
    s.slots = slots, s.num_experts = El, s.first_expert = rank * El, s.global_experts = E, s.tile_rows = tile;
    s.top_k = k, s.world_size = R, s.rank = rank, s.row_order = order;
    s.chunk_counts = chunk.as<int32_t>();
    s.counts = counts.as<int32_t>();
    s.source_counts = source_counts.as<int32_t>();
    s.offsets = offsets.as<int32_t>();
    s.row_of_slot = rows.as<int32_t>();
    cuda::build_schedule(s, d_ids.as<int32_t>(), nullptr, nullptr);
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());

    std::vector<int32_t> hc(El), hs(El * R), ho(El + 1), hr(R * slots);
    MOKA_CUDA_CHECK(cudaMemcpy(hc.data(), counts.data(), El * 4, cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(hs.data(), source_counts.data(), El * R * 4, cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(ho.data(), offsets.data(), (El + 1) * 4, cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(hr.data(), rows.data(), R * slots * 4, cudaMemcpyDeviceToHost));
    for (int64_t e = 0; e < El; ++e) {
      ASSERT_EQ(hc[e], ref.expert_rows[e]) << "expert " << e;
      ASSERT_EQ(ho[e], ref.expert_offset[e]) << "expert " << e;
      for (int r = 0; r < R; ++r) ASSERT_EQ(hs[e * R + r], ref.count(e, r)) << "expert " << e << " source " << r;
    }
    ASSERT_EQ(ho[El], ref.total_rows());
    std::vector<int32_t> row_source(ref.total_rows(), -1);
    std::vector<int64_t> row_slot(ref.total_rows(), -1);
    for (int64_t g = 0; g < R * slots; ++g) {
      if (hr[g] < 0) continue;
      row_source.at(hr[g]) = static_cast<int32_t>(g / slots);
      row_slot.at(hr[g]) = g % slots;
    }
    EXPECT_EQ(row_source, ref.row_source) << "rank " << rank;
    EXPECT_EQ(row_slot, ref.row_slot) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceScheduleAcrossRanks,
                         ::testing::Combine(::testing::Values(2, 4, 8), ::testing::Values<int64_t>(37, 300),
                                            ::testing::Values(core::RoutingKind::uniform, core::RoutingKind::zipf),
                                            ::testing::Values(RowOrder::round_robin, RowOrder::rate_based)));

// gather_rows copies every routed slot's token row to its grouped row, bit for bit, and leaves
// the rows of unrouted slots (-1) alone: row widths around the kernel's 32-lane and 8-load steps,
// slot counts around its 8 slots per block.
TEST(GatherRows, CopiesEveryRoutedRowAndNothingElse) {
  const uint64_t seed = gpu_test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int64_t width : {8, 248, 256, 264, 2048, 2056, 7168}) {
    for (int64_t slots : {1, 7, 9, 1000}) {
      SCOPED_TRACE("width " + std::to_string(width) + ", slots " + std::to_string(slots));
      const int64_t k = 3, tokens = (slots + k - 1) / k;
      std::vector<uint16_t> src(tokens * width);
      for (auto& v : src) v = static_cast<uint16_t>(rng());
      // A permutation of the grouped rows; every fifth slot unrouted.
      std::vector<int32_t> row_of_slot(slots);
      std::iota(row_of_slot.begin(), row_of_slot.end(), 0);
      std::shuffle(row_of_slot.begin(), row_of_slot.end(), rng);
      for (int64_t s = 0; s < slots; s += 5) row_of_slot[s] = -1;
      constexpr uint16_t kPoison = 0x7FC1;
      std::vector<uint16_t> expect(slots * width, kPoison);
      for (int64_t s = 0; s < slots; ++s)
        if (row_of_slot[s] >= 0) std::copy_n(&src[(s / k) * width], width, &expect[int64_t(row_of_slot[s]) * width]);

      gpu_test::DeviceTensor d_src(src.size() * 2), d_dst(expect.size() * 2), d_rows(slots * 4);
      MOKA_CUDA_CHECK(cudaMemcpy(d_src.data(), src.data(), src.size() * 2, cudaMemcpyHostToDevice));
      MOKA_CUDA_CHECK(cudaMemcpy(d_rows.data(), row_of_slot.data(), slots * 4, cudaMemcpyHostToDevice));
      const std::vector<uint16_t> poison(expect.size(), kPoison);
      MOKA_CUDA_CHECK(cudaMemcpy(d_dst.data(), poison.data(), poison.size() * 2, cudaMemcpyHostToDevice));
      cuda::gather_rows(d_src.as<cuda::bf16>(), d_dst.as<cuda::bf16>(), d_rows.as<int32_t>(), slots, k, width, nullptr);
      MOKA_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<uint16_t> got(expect.size());
      MOKA_CUDA_CHECK(cudaMemcpy(got.data(), d_dst.data(), got.size() * 2, cudaMemcpyDeviceToHost));
      ASSERT_EQ(got, expect);
    }
  }
}
