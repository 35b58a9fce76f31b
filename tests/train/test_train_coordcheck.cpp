// The coordinate check at CI widths 32..256: flat under muP, growing under SP.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "train/mup_experiments.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;

TEST(MupMath, LogLogSlopeOfAPowerLaw) {
  const std::vector<double> x{32, 64, 128, 256};
  std::vector<double> y;
  for (double v : x) y.push_back(3.0 * std::pow(v, 0.75));
  EXPECT_NEAR(loglog_slope(x, y), 0.75, 1e-12);
}

TEST(MupMath, ParabolaFitRecoversTheMinimum) {
  std::vector<double> x, y;
  for (int i = -3; i <= 3; ++i) {
    x.push_back(std::log(1e-3) + 0.5 * i);
    y.push_back(2.0 * std::pow(x.back() - std::log(2e-3), 2) + 1.5);
  }
  const auto p = fit_parabola(x, y);
  ASSERT_TRUE(p.has_minimum());
  EXPECT_NEAR(std::exp(p.argmin()), 2e-3, 1e-9);
  // find_optima picks the fit's vertex, and drift compares widest with base.
  std::vector<SweepPoint> pts;
  for (size_t i = 0; i < x.size(); ++i) {
    pts.push_back({32, std::exp(x[i]), y[i]});
    pts.push_back({64, std::exp(x[i]), y[i] + 0.1 * x[i]});  // tilted: optimum moves lower
  }
  const auto optima = find_optima(pts);
  ASSERT_EQ(optima.size(), 2u);
  EXPECT_TRUE(optima[0].from_fit);
  EXPECT_NEAR(optima[0].eta_star, 2e-3, 1e-9);
  EXPECT_LT(optima[1].eta_star, optima[0].eta_star);
}

namespace {
CoordCheckResult run_check(Parameterization p, const TextSplit& text) {
  CoordCheckConfig c;
  c.train = moka::train::testing::tiny_train_config(p, 1e-2);
  c.train.adam.weight_decay = 0;
  c.multipliers = {1, 2, 4, 8};
  c.steps = 5;
  return coord_check(c, text);
}
}  // namespace

TEST(CoordCheck, MupKeepsActivationsFlatAcrossWidth) {
  MOKA_REQUIRE_CORPUS(text);
  const auto r = run_check(Parameterization::mup, *text);
  ASSERT_EQ(r.rows.size(), 4u * 6u);
  const auto& last = r.slopes.back();
  for (int a = 0; a < ActivationStats::kCount; ++a)
    EXPECT_LT(std::abs(last[a]), 0.2) << ActivationStats::name(a) << " slope " << last[a];
}

TEST(CoordCheck, SpGrowsResidualAndLogitsWithWidth) {
  MOKA_REQUIRE_CORPUS(text);
  const auto r = run_check(Parameterization::sp, *text);
  const auto& last = r.slopes.back();
  const int residual = 4, logits = 5;
  ASSERT_STREQ(ActivationStats::name(residual), "residual");
  ASSERT_STREQ(ActivationStats::name(logits), "logits");
  EXPECT_GT(last[residual], 0.4);
  EXPECT_GT(last[logits], 0.4);
}

TEST(MupMath, ProcessRunnerCountsFailedAndCrashedRunsAsDiverged) {
  std::vector<std::vector<double>> got(12, {-1.0});
  run_jobs(
      got.size(), 3, true,
      [](size_t i) -> std::vector<double> {
        if (i == 3) throw moka::Error(moka::ErrorCode::cuda, "an illegal address");
        if (i == 5) std::abort();
        return {double(i) * 0.5, std::numeric_limits<double>::infinity(), -double(i)};
      },
      [&](size_t i, std::vector<double> v) { got[i] = std::move(v); });
  for (size_t i = 0; i < got.size(); ++i) {
    if (i == 3 || i == 5) EXPECT_TRUE(got[i].empty()) << i;
    else
      EXPECT_EQ(got[i], (std::vector<double>{double(i) * 0.5, std::numeric_limits<double>::infinity(), -double(i)}))
          << i;
  }
}

TEST(MupMath, ThreadRunnerRethrowsAFailedJob) {
  std::vector<int> seen(8, 0);
  EXPECT_THROW(run_jobs(
                   seen.size(), 2, false,
                   [](size_t i) -> std::vector<double> {
                     if (i == 2) throw moka::Error(moka::ErrorCode::invalid_argument, "bad run");
                     return {double(i)};
                   },
                   [&](size_t i, std::vector<double>) { ++seen[i]; }),
               moka::Error);
  EXPECT_EQ(seen[2], 0);
}
