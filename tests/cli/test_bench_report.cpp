// `moka bench`'s floor and torch matching (tools/bench_report.cpp), which its CUDA rows use over
// several GPUs where CI cannot run them.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench_report.hpp"
#include "moka/error.hpp"

namespace moka::cli {
namespace {

MoeShape shape() { return MoeShape{64, 32, 4, 2, 16, Activation::swiglu, 7.0f}; }

TEST(BenchFloor, RoutesPerRankCountsEachRanksExperts) {
  EXPECT_EQ(routes_per_rank({0, 1, 2, 3, 3, 1}, 2, 2), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(routes_per_rank({3, 3}, 1, 4), (std::vector<int64_t>{0, 0, 0, 2}));
}

TEST(BenchFloor, OneRankIsItsFlopsForwardAndTwiceBackward) {
  // 10 tokens, 20 routes: 6 * 20 * H * I routed + 6 * 10 * H * Is shared FLOPs at 1e-9 TFLOP/s.
  const double flops = 6.0 * 20 * 64 * 32 + 6.0 * 10 * 64 * 16;
  const LayerFloor f = layer_floor(shape(), 10, {20}, 1, 1e-9, std::nullopt);
  EXPECT_DOUBLE_EQ(f.flops_ms, flops / 1e3 * 1e3);
  EXPECT_EQ(f.bytes_ms, 0);
  EXPECT_DOUBLE_EQ(f.forward_ms(), f.flops_ms);
  EXPECT_DOUBLE_EQ(f.backward_ms(), 2 * f.flops_ms);
  EXPECT_DOUBLE_EQ(f.fwdbwd_ms(), 3 * f.flops_ms);
}

TEST(BenchFloor, SlowestRankSetsFlopsAndBytes) {
  // routes[s * 2 + r]: rank 0 sends 5 routes to itself and 7 to rank 1; rank 1 sends 1 to rank 0
  // and 11 to itself. Rank 1 computes 18 rows; each rank receives 7 + 1 rows over the link.
  const std::vector<int64_t> routes{5, 7, 1, 11};
  const double peak = 1e-6, link_gbs = 2.56e-6;
  const LayerFloor f = layer_floor(shape(), 12, routes, 2, peak, link_gbs);
  EXPECT_DOUBLE_EQ(f.flops_ms, (6.0 * 18 * 64 * 32 + 6.0 * 12 * 64 * 16) / (peak * 1e12) * 1e3);
  EXPECT_DOUBLE_EQ(f.bytes_ms, 8.0 * 64 * 2 / (link_gbs * 1e9) * 1e3);
  // Bytes dominate the forward here, the doubled FLOPs the backward.
  ASSERT_GT(f.bytes_ms, f.flops_ms);
  ASSERT_LT(f.bytes_ms, 2 * f.flops_ms);
  EXPECT_DOUBLE_EQ(f.fwdbwd_ms(), f.bytes_ms + 2 * f.flops_ms);
}

TEST(BenchFloor, RowGetsFloorAndDerivedRatios) {
  BenchRow row;
  row.fwdbwd_ms = 6;
  LayerFloor f;
  f.flops_ms = 1;
  f.bytes_ms = 0.5;
  set_floor(row, f, 900);
  set_torch(row, TorchResult{12, 4, 1000});
  const auto j = nlohmann::json::parse(bench_json(row));
  EXPECT_DOUBLE_EQ(j["floor_fwdbwd_ms"].get<double>(), 3);
  EXPECT_DOUBLE_EQ(j["fwdbwd_vs_floor"].get<double>(), 2);
  EXPECT_DOUBLE_EQ(j["speedup_vs_torch"].get<double>(), 2);
  EXPECT_EQ(j["torch_peak_memory_bytes"].get<int64_t>(), 1000);
  EXPECT_TRUE(j["peak_memory_bytes"].is_null());
  EXPECT_DOUBLE_EQ(j["dense_peak_tflops"].get<double>(), 900);
}

TEST(BenchTorchResult, MatchesShapeTokensAndRanks) {
  const std::string path = testing::TempDir() + "bench_torch_results.jsonl";
  {
    std::ofstream f(path);
    f << R"({"shape":"a","tokens_per_rank":64,"ep":2,"fwd_ms":1,"fwdbwd_ms":3,"peak_memory_bytes":77})"
      << "\n\n"
      << R"({"shape":"a","tokens_per_rank":64,"fwd_ms":2,"fwdbwd_ms":5})"
      << "\n"
      << R"({"shape":"a","tokens_per_rank":128,"error":"out of memory"})"
      << "\n";
  }
  const TorchResult two = torch_result(path, "a", 64, 2);
  EXPECT_EQ(two.fwdbwd_ms, 3);
  EXPECT_EQ(two.peak_memory_bytes, 77);
  const TorchResult one = torch_result(path, "a", 64, 1);  // no "ep": one rank
  EXPECT_EQ(one.fwdbwd_ms, 5);
  EXPECT_EQ(one.peak_memory_bytes, 0);
  BenchRow row;
  row.fwdbwd_ms = 1;
  set_torch(row, torch_result(path, "a", 128, 1));  // a failed torch case: no columns
  EXPECT_FALSE(row.torch_fwdbwd_ms);
  EXPECT_EQ(torch_result(path, "b", 64, 1).fwdbwd_ms, 0);
  EXPECT_EQ(torch_result("", "a", 64, 1).fwdbwd_ms, 0);
  std::remove(path.c_str());
}

TEST(BenchTorchResult, NamesTheBadLine) {
  const std::string path = testing::TempDir() + "bench_torch_results_bad.jsonl";
  {
    std::ofstream f(path);
    f << R"({"shape":"a","tokens_per_rank":64,"fwdbwd_ms":3})"
      << "\n{\"shape\":\n";
  }
  try {
    torch_result(path, "a", 64, 1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2: not a JSON object"), std::string::npos) << e.what();
  }
  EXPECT_THROW(torch_result(path + ".missing", "a", 64, 1), Error);
  std::remove(path.c_str());
}

// The kernel lab's refusal of impossible rows (bench/kernels/, case_bench_main): mixtral-8x7b's
// routing (8 experts, top 2) at 16384 tokens must give 32768 to 32768 + 127 * 8 grouped rows; an
// H200 run printed 3072 and 370% of the dense peak when the lab's schedule raced its buffers'
// zeroing (tools/gpu/device_tensors.cpp).
TEST(LabRowCheck, RefusesGroupedRowsOutsideTheRoutesAndTheirPadding) {
  const MoeShape mixtral{4096, 14336, 8, 2, 0, Activation::swiglu, 7.0f};
  BenchRow row;
  row.shape = "mixtral-8x7b";
  row.path = "mk-backward-core";
  for (int64_t rows : {32768, 32768 + 5 * 128, 32768 + 127 * 8}) {
    row.extra["grouped_rows"] = rows;
    EXPECT_NO_THROW(check_lab_row(row, mixtral, 16384)) << rows;
  }
  for (int64_t rows : {0, 3072, 32767, 32768 + 127 * 8 + 1}) {
    row.extra["grouped_rows"] = rows;
    try {
      check_lab_row(row, mixtral, 16384);
      ADD_FAILURE() << rows << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::internal);
      EXPECT_NE(std::string(e.what()).find("grouped_rows " + std::to_string(rows) + " outside [32768, 33784]"),
                std::string::npos)
          << e.what();
    }
  }
  row.extra["grouped_rows"] = "3072";  // not a count
  EXPECT_THROW(check_lab_row(row, mixtral, 16384), Error);
  row.extra.erase("grouped_rows");  // a bench without grouped rows (staged_baselines)
  EXPECT_NO_THROW(check_lab_row(row, mixtral, 16384));
}

TEST(LabRowCheck, RefusesAShareOfThePeakAbove100) {
  const MoeShape qwen3{2048, 768, 128, 8, 0, Activation::swiglu, 7.0f};
  BenchRow row;
  row.extra["grouped_rows"] = 131072 + 3000;
  row.extra["backward_pct_peak"] = 71.5;
  row.extra["core_pct_peak"] = 100.0;
  EXPECT_NO_THROW(check_lab_row(row, qwen3, 16384));
  row.extra["backward_pct_peak"] = 370.2;
  try {
    check_lab_row(row, qwen3, 16384);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("backward_pct_peak 370.2 is above 100%"), std::string::npos) << e.what();
  }
  row.extra["backward_pct_peak"] = nullptr;  // not a number (a NaN is written as null)
  EXPECT_THROW(check_lab_row(row, qwen3, 16384), Error);
  row.extra.erase("backward_pct_peak");
  row.extra["dense_peak_tflops"] = 780.0;  // not a share of it
  EXPECT_NO_THROW(check_lab_row(row, qwen3, 16384));
}

}  // namespace
}  // namespace moka::cli
