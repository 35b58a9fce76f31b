// The token-horizon study's math (LR optimum per budget, power law over budgets, held-out
// check, spread over seeds) on synthetic curves with known answers, and the seeded LR sweep.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "train/lr_horizon.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;

namespace {

std::vector<double> log_grid(double lo, double hi, int n) {
  std::vector<double> out;
  for (int i = 0; i < n; ++i) out.push_back(lo * std::pow(hi / lo, double(i) / double(n - 1)));
  return out;
}

// L(eta) = a (ln eta - ln eta*)^2 + c on the grid.
std::vector<double> quadratic_curve(const std::vector<double>& lrs, double eta_star, double a, double c) {
  std::vector<double> out;
  for (double lr : lrs) out.push_back(a * std::pow(std::log(lr / eta_star), 2) + c);
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const moka::Error& e) {
    EXPECT_EQ(e.code(), moka::ErrorCode::invalid_argument) << e.what();
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(HorizonMath, LrOptimumOfAKnownQuadratic) {
  const auto lrs = log_grid(1e-4, 1e-1, 9);
  const auto o = fit_lr_optimum(lrs, quadratic_curve(lrs, 3.3e-3, 0.2, 2.5));
  EXPECT_NEAR(o.eta_star, 3.3e-3, 1e-12);
  EXPECT_NEAR(o.fit.a, 0.2, 1e-9);
  EXPECT_NEAR(std::exp(-o.fit.b / (2 * o.fit.a)), 3.3e-3, 1e-12);
  EXPECT_EQ(o.best_grid_lr, lrs[4]);  // 3.16e-3, the grid point nearest 3.3e-3
}

TEST(HorizonMath, LrOptimumRefusesDegenerateCurves) {
  const auto lrs = log_grid(1e-4, 1e-1, 7);
  // a <= 0: a maximum, not a minimum (the best point is at an end; force a window around a
  // concave middle by making the ends diverge).
  auto concave = quadratic_curve(lrs, 3e-3, -0.2, 3.0);
  concave.front() = concave.back() = INFINITY;
  EXPECT_NE(error_of([&] { fit_lr_optimum(lrs, concave); }).find("no minimum"), std::string::npos);
  // Too few finite points around the best one.
  std::vector<double> two{2.0, 1.5, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY};
  EXPECT_NE(error_of([&] { fit_lr_optimum(lrs, two); }).find("the parabola needs 3"), std::string::npos);
  // Every run diverged.
  EXPECT_NE(error_of([&] { fit_lr_optimum(lrs, std::vector<double>(7, INFINITY)); }).find("every run diverged"),
            std::string::npos);
  // The optimum past the grid's edge.
  EXPECT_NE(error_of([&] { fit_lr_optimum(lrs, quadratic_curve(lrs, 1.0, 0.2, 2.0)); }).find("grid's edge"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fit_lr_optimum({3e-3, 1e-3, 1e-2}, {1, 2, 3}); }).find("ascend"), std::string::npos);
}

TEST(HorizonMath, PowerLawOfKnownData) {
  std::vector<double> x, y;
  for (double b : {1e6, 2e6, 4e6, 8e6, 16e6}) {
    x.push_back(b);
    y.push_back(0.7 * std::pow(b, -0.3));
  }
  const auto p = fit_power_law(x, y);
  EXPECT_NEAR(p.beta, -0.3, 1e-12);
  EXPECT_NEAR(p.gamma, std::log(0.7), 1e-9);
  EXPECT_NEAR(p.r2, 1.0, 1e-12);
  EXPECT_EQ(p.points, 5);
  EXPECT_NEAR(p.at(1e9), 0.7 * std::pow(1e9, -0.3), 1e-12);
  // Scatter lowers R^2 below 1.
  y[1] *= 1.2;
  y[3] *= 0.8;
  EXPECT_LT(fit_power_law(x, y).r2, 0.99);
}

TEST(HorizonMath, PowerLawRefusesDegenerateInput) {
  EXPECT_NE(error_of([] { fit_power_law({1e6}, {1e-3}); }).find("needs 2 or more"), std::string::npos);
  EXPECT_NE(error_of([] { fit_power_law({1e6, 2e6}, {1e-3, 0}); }).find("positive"), std::string::npos);
  EXPECT_NE(error_of([] { fit_power_law({1e6, 1e6}, {1e-3, 2e-3}); }).find("every x is the same"), std::string::npos);
}

TEST(HorizonMath, SpreadOfValues) {
  const auto s = spread_of({1, 2, 3, 4});
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_NEAR(s.std, std::sqrt(5.0 / 3.0), 1e-12);
  EXPECT_EQ(s.min, 1);
  EXPECT_EQ(s.max, 4);
  EXPECT_EQ(s.count, 4);
  EXPECT_EQ(spread_of({7}).std, 0);
  EXPECT_EQ(spread_of({}).count, 0);
}

namespace {
LrHorizonConfig synthetic_config() {
  LrHorizonConfig c;
  c.train.batch = 8;
  c.train.seq = 128;  // 1024 tokens per step
  c.train.ema_decay = 0.9;
  c.train.schedule.total_steps = 600;
  c.lrs = log_grid(1e-4, 1e-1, 11);
  c.eval_every = 100;
  c.holdout = 2;
  c.predict_tokens = {1e8};
  return c;
}
}  // namespace

TEST(HorizonMath, AnalysisRecoversAKnownExponentWithItsSpread) {
  const auto c = synthetic_config();
  const auto budgets = check_horizon_config(c);
  ASSERT_EQ(budgets.size(), 6u);
  // eta*(B) = 0.5 B^-0.3 exactly for seed 0; seed 1's exponent is -0.35: beta's spread shows it.
  const std::vector<double> betas{-0.3, -0.35};
  std::vector<std::vector<std::vector<double>>> runs(2, std::vector<std::vector<double>>(c.lrs.size()));
  for (size_t s = 0; s < 2; ++s)
    for (int64_t steps : budgets) {
      const double tokens = double(steps * 1024);
      const auto curve = quadratic_curve(c.lrs, 0.5 * std::pow(tokens, betas[s]), 0.1, 3.0 - 1e-4 * double(steps));
      for (size_t l = 0; l < c.lrs.size(); ++l) runs[s][l].push_back(curve[l]);
    }
  auto one_seed = c;
  one_seed.seeds = 1;
  const auto exact = analyze_horizon(one_seed, budgets, {runs[0]});
  EXPECT_NEAR(exact.fit.beta, -0.3, 1e-9);
  EXPECT_NEAR(exact.fit.r2, 1.0, 1e-9);
  ASSERT_EQ(exact.held_out.size(), 2u);
  EXPECT_TRUE(exact.budgets[4].held_out && exact.budgets[5].held_out && !exact.budgets[3].held_out);
  EXPECT_LT(exact.held_out_max_error, 1e-9);
  EXPECT_EQ(exact.holdout_fit.points, 4);
  ASSERT_EQ(exact.extrapolated.size(), 1u);
  EXPECT_NEAR(exact.extrapolated[0].second, 0.5 * std::pow(1e8, -0.3), 1e-12);

  auto two_seeds = c;
  two_seeds.seeds = 2;
  const auto seeded = analyze_horizon(two_seeds, budgets, runs);
  ASSERT_EQ(seeded.beta_per_seed.size(), 2u);
  EXPECT_NEAR(seeded.beta_per_seed[0], -0.3, 1e-9);
  EXPECT_NEAR(seeded.beta_per_seed[1], -0.35, 1e-9);
  EXPECT_NEAR(seeded.beta_spread.mean, -0.325, 1e-9);
  EXPECT_NEAR(seeded.beta_spread.std, 0.05 / std::sqrt(2.0), 1e-9);
  EXPECT_EQ(seeded.budgets[0].log_eta_star_seeds.count, 2);
  EXPECT_GT(seeded.budgets[0].loss_std[0], 0);
}

TEST(HorizonMath, AnalysisLeavesOutBudgetsWithoutAnOptimumAndRefusesTooFew) {
  const auto c = synthetic_config();
  const auto budgets = check_horizon_config(c);
  std::vector<std::vector<std::vector<double>>> runs(1, std::vector<std::vector<double>>(c.lrs.size()));
  for (size_t b = 0; b < budgets.size(); ++b) {
    // The first budget's optimum lies past the grid's top: that budget is left out, with why.
    const double eta = b == 0 ? 1.0 : 1e-2 / double(b + 1);
    const auto curve = quadratic_curve(c.lrs, eta, 0.1, 3.0);
    for (size_t l = 0; l < c.lrs.size(); ++l) runs[0][l].push_back(curve[l]);
  }
  const auto r = analyze_horizon(c, budgets, runs);
  EXPECT_FALSE(r.budgets[0].usable);
  EXPECT_NE(r.budgets[0].why_not.find("grid's edge"), std::string::npos);
  EXPECT_EQ(r.fit.points, 5);
  auto more_held_out = c;
  more_held_out.holdout = 4;
  EXPECT_NE(error_of([&] { analyze_horizon(more_held_out, budgets, runs); }).find("5 of 6 budgets"), std::string::npos);
}

TEST(HorizonMath, FitFromLeavesTheEarlyBudgetsOutOfTheFit) {
  auto c = synthetic_config();
  c.fit_from = 300;
  const auto budgets = check_horizon_config(c);
  std::vector<std::vector<std::vector<double>>> runs(1, std::vector<std::vector<double>>(c.lrs.size()));
  for (int64_t steps : budgets) {
    // The first two budgets fall off a steeper law: without them the fit is exact.
    const double tokens = double(steps * 1024);
    const double eta = steps < 300 ? 2.0 * std::pow(tokens, -0.5) : 0.5 * std::pow(tokens, -0.3);
    const auto curve = quadratic_curve(c.lrs, eta, 0.1, 3.0);
    for (size_t l = 0; l < c.lrs.size(); ++l) runs[0][l].push_back(curve[l]);
  }
  const auto r = analyze_horizon(c, budgets, runs);
  EXPECT_TRUE(r.budgets[0].usable);
  EXPECT_FALSE(r.budgets[0].fitted || r.budgets[1].fitted);
  EXPECT_TRUE(r.budgets[2].fitted);
  EXPECT_EQ(r.fit.points, 4);
  EXPECT_NEAR(r.fit.beta, -0.3, 1e-9);
  EXPECT_NEAR(r.beta_per_seed[0], -0.3, 1e-9);
  EXPECT_LT(r.held_out_max_error, 1e-9);
  c.fit_from = 400;  // leaves 3 budgets: one short of 2 plus --holdout 2
  EXPECT_NE(error_of([&] { check_horizon_config(c); }).find("has 3 budget(s) to fit"), std::string::npos);
}

TEST(HorizonConfig, BudgetsSkipTheEmaStartAndNeedEnoughPoints) {
  auto c = synthetic_config();
  c.train.ema_decay = 0.99;  // keeps 1% of the start until step 459
  c.train.schedule.total_steps = 1000;
  const auto budgets = check_horizon_config(c);
  ASSERT_FALSE(budgets.empty());
  EXPECT_EQ(budgets.front(), 500);
  EXPECT_EQ(budgets.back(), 1000);
  c.train.schedule.total_steps = 700;  // 500, 600, 700: one short of holdout 2 + 2
  EXPECT_NE(error_of([&] { check_horizon_config(c); }).find("the fit needs 2 plus --holdout 2"), std::string::npos);
  c = synthetic_config();
  c.train.ema_decay = 0;
  EXPECT_NE(error_of([&] { check_horizon_config(c); }).find("--ema must be in (0, 1)"), std::string::npos);
  c = synthetic_config();
  c.wsd_check_steps = {150};
  EXPECT_NE(error_of([&] { check_horizon_config(c); }).find("--wsd-check 150 is not one of"), std::string::npos);
  c = synthetic_config();
  c.lrs = {1e-3, 1e-2};
  EXPECT_NE(error_of([&] { check_horizon_config(c); }).find("3 or more LRs"), std::string::npos);
}

TEST(LrHorizon, TinyCpuStudyWithAWsdCheck) {
  MOKA_REQUIRE_CORPUS(text);
  LrHorizonConfig c;
  c.train = moka::train::testing::tiny_train_config(Parameterization::mup, 1e-3);
  c.train.ema_decay = 0.75;
  c.train.schedule = {ScheduleKind::constant, 5, 60, 0.2, 0.0};
  c.lrs = log_grid(1e-3, 1e-1, 5);
  c.eval_every = 20;
  c.holdout = 1;
  c.eval_batches = 2;
  c.wsd_check_steps = {40};
  c.workers = 2;
  int reported = 0;
  const auto r = lr_horizon(c, *text, [&](const std::string&, int, int) { ++reported; });
  ASSERT_EQ(r.budgets.size(), 3u);
  EXPECT_EQ(r.runs.size(), 1u);
  EXPECT_EQ(r.fit.points,
            int(std::count_if(r.budgets.begin(), r.budgets.end(), [](const auto& b) { return b.usable; })));
  EXPECT_TRUE(std::isfinite(r.fit.beta));
  ASSERT_EQ(r.wsd_checks.size(), 1u);
  EXPECT_EQ(r.wsd_checks[0].steps, 40);
  EXPECT_EQ(r.wsd_checks[0].wsd_loss.size(), 5u);
  // The WSD run's EMA twin is the horizon run's evaluation at the same budget.
  EXPECT_EQ(r.wsd_checks[0].ema_loss[2], r.runs[0][2][1]);
  EXPECT_EQ(reported, 5 + 5);  // every horizon run and every WSD run
}

TEST(LrSweep, SeedsGiveEachWidthAndTheDriftASpread) {
  MOKA_REQUIRE_CORPUS(text);
  LrSweepConfig c;
  c.train = moka::train::testing::tiny_train_config(Parameterization::mup, 1e-3);
  c.train.schedule = {ScheduleKind::wsd, 2, 10, 0.2, 0.0};
  c.multipliers = {1, 2};
  c.lrs = log_grid(1e-3, 1e-1, 3);
  c.seeds = 2;
  c.eval_batches = 1;
  c.workers = 2;
  const auto r = lr_sweep(c, *text);
  ASSERT_EQ(r.points.size(), 2u * 3u * 2u);
  std::set<uint64_t> seeds;
  for (const auto& p : r.points) seeds.insert(p.seed);
  EXPECT_EQ(seeds, (std::set<uint64_t>{c.train.seed, c.train.seed + 1}));
  ASSERT_EQ(r.per_seed.size(), 2u);
  ASSERT_EQ(r.log2_eta_star_spread.size(), 2u);
  EXPECT_EQ(r.log2_eta_star_spread[0].count, 2);
  EXPECT_EQ(r.drift_spread.count, 2);
  for (size_t w = 0; w < 2; ++w) {
    const auto& s = r.log2_eta_star_spread[w];
    EXPECT_LE(s.min, s.mean);
    EXPECT_LE(s.mean, s.max);
    for (const auto& so : r.per_seed) {
      EXPECT_GE(std::log2(so.optima[w].eta_star), s.min - 1e-12);
      EXPECT_LE(std::log2(so.optima[w].eta_star), s.max + 1e-12);
    }
  }
  // The seeds differ (init and data), so at least one run's loss does too.
  EXPECT_NE(r.points[0].loss, r.points[1].loss);
}

TEST(TrainLoop, ValidationSeedFixesTheValidationBatchesAcrossTrainingSeeds) {
  MOKA_REQUIRE_CORPUS(text);
  auto c = moka::train::testing::tiny_train_config(Parameterization::mup, 1e-3);
  c.threads = 1;
  Trainer plain(c, *text);
  auto same = c;
  same.validation_seed = c.seed;  // unset means the training seed
  Trainer explicit_seed(same, *text);
  EXPECT_EQ(plain.evaluate(2), explicit_seed.evaluate(2));
  auto other = c;
  other.validation_seed = c.seed + 7;  // same weights, other validation batches
  Trainer moved(other, *text);
  EXPECT_NE(plain.evaluate(2), moved.evaluate(2));
}

// The runs of both studies read their numbers only now and then (a wait for the GPU each): the
// losses at the asked steps must still be those of a run evaluated step by step.
TEST(TrainAndEvaluate, LossesAtTheAskedStepsEqualAStepByStepRun) {
  MOKA_REQUIRE_CORPUS(text);
  TrainConfig c = moka::train::testing::tiny_train_config(Parameterization::mup, 3e-3);
  c.schedule = {ScheduleKind::wsd, 2, 37, 0.2, 0.0};
  c.ema_decay = 0.9;
  const std::vector<int64_t> at = {3, 16, 17, 37};  // off, on and after the 16-step checks
  const auto got = train_and_evaluate_at(c, *text, at, 2, true);
  Trainer trainer(c, *text);
  std::vector<double> want;
  for (int64_t s : at) {
    while (trainer.steps_done() < s) trainer.step();
    want.push_back(trainer.evaluate(2, true));
  }
  ASSERT_EQ(got.size(), at.size());
  for (size_t i = 0; i < at.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got[i])) << "step " << at[i];
    EXPECT_EQ(got[i], want[i]) << "step " << at[i];
  }
}

TEST(TrainAndEvaluate, ARunThatDivergesIsInfinityFromThenOn) {
  MOKA_REQUIRE_CORPUS(text);
  TrainConfig c = moka::train::testing::tiny_train_config(Parameterization::mup, 1e30);
  c.schedule = {ScheduleKind::constant, 0, 40, 0.0, 0.0};
  const auto losses = train_and_evaluate_at(c, *text, {5, 40}, 1, false);
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_TRUE(std::isinf(losses[0]) && losses[0] > 0);
  EXPECT_TRUE(std::isinf(losses[1]) && losses[1] > 0);
}
