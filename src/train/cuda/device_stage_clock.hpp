// The CUDA engine's stage clock (TrainConfig::profile, `moka train --profile`): CUDA events on the
// engine's stream, which a captured step holds as graph nodes, so eager and replayed steps are
// timed alike. A header of its own: the engine's Impl holds one, its step (engine_step.cpp) uses it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/common/check.hpp"
#include "train/step_profile.hpp"

namespace moka::train {

// Every launch the captured step holds: kernels, memsets and memcpys (the event records that
// mark stages and the graph's memory nodes are not launches).
inline int64_t launches_in(cudaGraph_t graph) {
  size_t n = 0;
  MOKA_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  MOKA_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  int64_t launches = 0;
  for (auto node : nodes) {
    cudaGraphNodeType type;
    MOKA_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    launches += type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset || type == cudaGraphNodeTypeMemcpy;
  }
  return launches;
}

// The GPU engine's stage clock: each mark records an event on the engine's stream (inside a
// capture, an event-record node of the graph, so every replay records it). After the step has
// finished, the time between consecutive marks is the earlier mark's stage's. While counting, a
// mark also notes how many launches the capture holds so far.
class DeviceStageClock final : public StageMarker {
 public:
  struct Mark {
    int stage;  // -1: the step's end
    cudaEvent_t event;
    int64_t launches_before;
  };
  DeviceStageClock(cudaStream_t stream, StepProfile& profile) : stream_(stream), profile_(profile) {}
  ~DeviceStageClock() {
    for (auto* pool : {&eager_, &captured_})
      for (auto e : *pool) cudaEventDestroy(e);
  }
  DeviceStageClock(const DeviceStageClock&) = delete;
  DeviceStageClock& operator=(const DeviceStageClock&) = delete;

  void new_step() {
    marks_.clear();
    next_eager_ = 0;
  }
  // While the stream is capturing, marks become event-record nodes of the graph.
  void set_capture(bool capture) { capture_ = capture; }
  void mark(Stage s) override { record(int(s)); }
  // The marks so far, handed over; end() first marks the end of the step.
  std::vector<Mark> take() { return std::exchange(marks_, {}); }
  std::vector<Mark> end() {
    record(-1);
    return take();
  }

  // After the marks' work has finished: adds each stage's time (and, from a capture's marks,
  // its launches) to the profile.
  void accumulate(const std::vector<Mark>& marks) {
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      float ms = 0;
      MOKA_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i].event, marks[i + 1].event));
      profile_.add_stage(Stage(marks[i].stage), ms);
    }
    float total = 0;
    MOKA_CUDA_CHECK(cudaEventElapsedTime(&total, marks.front().event, marks.back().event));
    profile_.step_ms += total;
    ++profile_.steps;
  }
  void count_launches(const std::vector<Mark>& marks, int64_t launches_per_step) {
    profile_.launches = {};
    for (size_t i = 0; i + 1 < marks.size(); ++i)
      profile_.launches[size_t(marks[i].stage)] += marks[i + 1].launches_before - marks[i].launches_before;
    profile_.launches_per_step = launches_per_step;
  }

 private:
  void record(int stage) {
    int64_t launches = 0;
    cudaEvent_t e;
    if (capture_) {
      // The graph's node records this event at every replay: it is never recorded eagerly.
      e = create(captured_);
      MOKA_CUDA_CHECK(cudaEventRecordWithFlags(e, stream_, cudaEventRecordExternal));
      cudaStreamCaptureStatus status;
      cudaGraph_t graph = nullptr;
      MOKA_CUDA_CHECK(cudaStreamGetCaptureInfo(stream_, &status, nullptr, &graph));
      launches = launches_in(graph);
    } else {
      e = next_eager_ < eager_.size() ? eager_[next_eager_] : create(eager_);
      ++next_eager_;
      MOKA_CUDA_CHECK(cudaEventRecord(e, stream_));
    }
    marks_.push_back({stage, e, launches});
  }
  static cudaEvent_t create(std::vector<cudaEvent_t>& pool) {
    cudaEvent_t e;
    MOKA_CUDA_CHECK(cudaEventCreate(&e));
    pool.push_back(e);
    return e;
  }

  cudaStream_t stream_;
  StepProfile& profile_;
  std::vector<cudaEvent_t> eager_, captured_;  // eager marks reuse theirs step after step
  size_t next_eager_ = 0;
  bool capture_ = false;
  std::vector<Mark> marks_;
};

}  // namespace moka::train
