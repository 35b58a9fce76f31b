// Per-stage GPU times of a layer's calls (MoeLayer::record_stage_times, `moka bench
// --breakdown`). While on, a call records a timed event at its start and one after each stage on
// its stream; read() turns the last forward's and the last backward's into milliseconds once the
// caller has synchronized those streams. Off (the default), every method returns at once, and a
// call on a stream being captured into a graph records nothing (its events would time the
// capture, not the replays).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "moka/layer.hpp"

namespace moka::cuda {

class StageClock {
 public:
  enum class Direction : int { forward = 0, backward = 1 };

  StageClock() = default;
  ~StageClock();
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;

  void set_on(bool on);
  bool on() const { return on_; }
  // A call of `direction` starts on `stream`: that direction's last timeline is replaced.
  void start(Direction direction, cudaStream_t stream);
  // The current call's stage named `stage` ends here (its time runs from the previous mark).
  void mark(const char* stage, cudaStream_t stream);
  // The last forward's stages, then the last backward's (the streams must be synchronized).
  std::vector<StageTime> read() const;

 private:
  struct Timeline {
    std::vector<cudaEvent_t> events;  // reused from call to call; events[0] is the start
    std::vector<std::string> stages;  // stages[i] ends at events[i + 1]
    bool recorded = false;
  };
  cudaEvent_t event_at(Timeline& line, size_t index);

  mutable std::mutex mutex_;
  std::atomic<bool> on_{false};
  Timeline lines_[2];
  Timeline* current_ = nullptr;  // null: the current call records nothing
};

}  // namespace moka::cuda
