// StageClock (stage_clock.hpp).
#include "cuda/common/stage_clock.hpp"

#include "cuda/common/check.hpp"
#include "cuda/common/stream.hpp"

namespace moka::cuda {

StageClock::~StageClock() {
  for (Timeline& line : lines_)
    for (cudaEvent_t e : line.events) cudaEventDestroy(e);
}

void StageClock::set_on(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_ = on;
  if (!on) current_ = nullptr;
}

cudaEvent_t StageClock::event_at(Timeline& line, size_t index) {
  while (line.events.size() <= index) {
    cudaEvent_t e = nullptr;
    MOKA_CUDA_CHECK(cudaEventCreate(&e));
    line.events.push_back(e);
  }
  return line.events[index];
}

void StageClock::start(Direction direction, cudaStream_t stream) {
  if (!on_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = nullptr;
  if (!on_ || is_capturing(stream)) return;
  Timeline& line = lines_[int(direction)];
  line.stages.clear();
  line.recorded = true;
  MOKA_CUDA_CHECK(cudaEventRecord(event_at(line, 0), stream));
  current_ = &line;
}

void StageClock::mark(const char* stage, cudaStream_t stream) {
  if (!on_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!current_) return;
  MOKA_CUDA_CHECK(cudaEventRecord(event_at(*current_, current_->stages.size() + 1), stream));
  current_->stages.emplace_back(stage);
}

std::vector<StageTime> StageClock::read() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<StageTime> times;
  const char* names[] = {"forward", "backward"};
  for (int d = 0; d < 2; ++d) {
    const Timeline& line = lines_[d];
    if (!line.recorded) continue;
    for (size_t i = 0; i < line.stages.size(); ++i) {
      float ms = 0;
      MOKA_CUDA_CHECK(cudaEventElapsedTime(&ms, line.events[i], line.events[i + 1]));
      times.push_back({names[d], line.stages[i], double(ms)});
    }
  }
  return times;
}

}  // namespace moka::cuda
