// Where a training step's time goes (`moka train --profile`): the step split into stages, each
// timed on the engine's clock (CUDA events on the GPU, the host's steady clock on the CPU), with
// the kernel launches and host synchronizations per step.
#pragma once
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace moka::train {

// In the order a step runs them. `norms` is every RMSNorm with its residual add; `head_loss` the
// final norm, LM head and cross-entropy; `ema` and `router_bias` the updates after AdamW.
enum class Stage : int {
  embedding_forward,
  norms_forward,
  attention_forward,
  moe_forward,
  head_loss_forward,
  head_loss_backward,
  moe_backward,
  norms_backward,
  attention_backward,
  embedding_backward,
  optimizer,
  ema,
  router_bias,
  inputs,  // the batch's and the step's scalars' copy to the engine
};
inline constexpr int kStageCount = int(Stage::inputs) + 1;
const char* stage_name(Stage s);

// Marks where each stage starts within a step; a stage runs until the next mark. A stage may be
// entered many times per step (once per layer): its times add up.
class StageMarker {
 public:
  virtual ~StageMarker() = default;
  virtual void mark(Stage s) = 0;
};

// Sums over the profiled steps.
struct StepProfile {
  std::string clock;  // "cuda events" or "host steady_clock"
  std::string mode;   // "cuda graph", "eager" or "cpu"
  int64_t steps = 0;
  std::array<double, kStageCount> ms{};
  // Per step (one step's count, not a sum). Kernel launches: every kernel, memset and memcpy the
  // step puts on the stream (library kernels included), counted from the captured step; -1 where
  // the engine has no launches (the CPU).
  std::array<int64_t, kStageCount> launches{};
  int64_t launches_per_step = -1;
  int64_t host_syncs = 0;  // waits for the device inside the steps (reads included), profiling's own excluded
  double host_ms = 0;      // the host's time inside step() (enqueueing, on the GPU)
  double step_ms = 0;      // the whole step on the engine's clock

  void add_stage(Stage s, double milliseconds) { ms[size_t(s)] += milliseconds; }
  nlohmann::json to_json() const;
  std::string table() const;  // one row per stage: ms per step, share, launches
};

}  // namespace moka::train
