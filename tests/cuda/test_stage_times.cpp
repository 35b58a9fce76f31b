// Per-stage timing (MoeLayer::record_stage_times, `moka bench --breakdown`): each path names its
// stages in the order it runs them, the stages add up to the call's time, timing changes no bit,
// and nothing is recorded while off or while the stream is captured.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "gpu_case.hpp"
#include "moka/moka.hpp"

using namespace moka;
using gpu_test::GpuCase;

namespace {

using gpu_test::routed_case;
using gpu_test::shape;

// One direction's stage names and the sum of their times.
struct Direction {
  std::vector<std::string> stages;
  double ms = 0;
};
Direction direction_of(const std::vector<StageTime>& times, const std::string& name) {
  Direction d;
  for (const StageTime& t : times) {
    if (t.direction != name) continue;
    EXPECT_GE(t.ms, 0.0) << t.stage;
    d.stages.push_back(t.stage);
    d.ms += t.ms;
  }
  return d;
}

// Events around one forward and one backward on `stream`: the two calls' times.
struct StepTimes {
  double fwd_ms = 0, bwd_ms = 0;
};
StepTimes timed_step(MoeLayer& layer, GpuCase& c, cudaStream_t stream) {
  cudaEvent_t e[3];
  for (auto& event : e) MOKA_CUDA_CHECK(cudaEventCreate(&event));
  MOKA_CUDA_CHECK(cudaEventRecord(e[0], stream));
  auto ctx = layer.forward(c.inputs(), c.weights(), c.out_view(), Stream{stream});
  MOKA_CUDA_CHECK(cudaEventRecord(e[1], stream));
  layer.backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{stream});
  MOKA_CUDA_CHECK(cudaEventRecord(e[2], stream));
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
  float fwd = 0, bwd = 0;
  MOKA_CUDA_CHECK(cudaEventElapsedTime(&fwd, e[0], e[1]));
  MOKA_CUDA_CHECK(cudaEventElapsedTime(&bwd, e[1], e[2]));
  for (auto event : e) cudaEventDestroy(event);
  return {fwd, bwd};
}

// The stages cover the call: their sum is the time between events recorded around it, up to
// the few microseconds between the call's entry and its first event (and timer resolution).
void expect_covers(const Direction& d, double call_ms, const char* what) {
  EXPECT_LE(d.ms, call_ms + 0.01) << what;
  EXPECT_GE(d.ms, 0.8 * call_ms - 0.1) << what;
}

// Times one step with the clock on and checks names and sums; the outputs are the bits of a
// step with the clock off.
void check_path(MoeLayer& layer, GpuCase& c, const std::vector<std::string>& forward,
                const std::vector<std::string>& backward) {
  cudaStream_t stream;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  gpu_test::run_gpu(layer, c, stream);
  EXPECT_TRUE(layer.stage_times().empty()) << "the clock is off by default";
  const auto untimed = c.output_bytes();
  c.poison();
  layer.record_stage_times(true);
  const StepTimes step = timed_step(layer, c, stream);
  layer.check_errors();
  EXPECT_TRUE(c.output_bytes() == untimed) << "timing the stages changed an output";
  const auto times = layer.stage_times();
  const Direction f = direction_of(times, "forward"), b = direction_of(times, "backward");
  EXPECT_EQ(f.stages, forward);
  EXPECT_EQ(b.stages, backward);
  expect_covers(f, step.fwd_ms, "forward");
  expect_covers(b, step.bwd_ms, "backward");
  // Captured into a graph: the clock records nothing, and keeps the last eager call's times.
  gpu_test::replay_in_graph(
      [&](Stream s) {
        auto ctx = layer.forward(c.inputs(), c.weights(), c.out_view(), s);
        layer.backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), s);
      },
      1, [&](int) { layer.check_errors(); });
  const auto after_capture = layer.stage_times();
  ASSERT_EQ(after_capture.size(), times.size());
  for (size_t i = 0; i < times.size(); ++i) EXPECT_EQ(after_capture[i].stage, times[i].stage);
  layer.record_stage_times(false);
  MOKA_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(StageTimes, SingleGpuPathNamesEveryStage) {
  const MoeShape s = shape(512, 256, 16, 4, 128);
  GpuCase c = routed_case(s, 300, gpu_test::fresh_seed());
  for (SaveMode save : {SaveMode::gate_up, SaveMode::none}) {
    SCOPED_TRACE(to_string(save));
    LayerOptions o;
    o.path = LayerPath::single_gpu;
    o.save = save;
    auto layer = make_moe_layer(s, Backend::cuda, nullptr, o);
    // x's rows are gathered where they are first read: for the recomputed gate|up, else for the
    // gate and up weight gradients.
    std::vector<std::string> backward =
        save == SaveMode::none
            ? std::vector<std::string>{"gather_x",        "recompute_gate_up", "gather_d_out",         "dh",
                                       "swiglu_backward", "weight_grads_down", "weight_grads_gate_up", "dx",
                                       "reduce"}
            : std::vector<std::string>{"gather_d_out",         "dh", "swiglu_backward", "weight_grads_down", "gather_x",
                                       "weight_grads_gate_up", "dx", "reduce"};
    check_path(*layer, c, {"schedule", "gather", "gate_up", "swiglu", "down", "combine"}, backward);
  }
}

TEST(StageTimes, MegakernelPathNamesEveryStage) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  const int64_t T = 200;
  GpuCase c = routed_case(s, T, gpu_test::fresh_seed());
  auto layer = make_moe_layer(s, nullptr, gpu_test::megakernel_options(gpu_test::megakernel_config(8, 1024, 4096), T));
  ASSERT_NE(layer->megakernel(), nullptr);
  check_path(*layer, c, {"inputs", "schedule", "megakernel", "combine", "status"},
             {"unpack", "setup", "megakernel", "epilogue", "status"});
}

}  // namespace
