// What the CPU emulations of the forward and backward megakernels share: the error word every
// worker polls, bounded counter waits, the collective input checks and the host steps around
// the "kernel" (publishing the symmetric buffers, barriers).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/validate.hpp"
#include "core/megakernel_plan.hpp"
#include "moka/process_group.hpp"

namespace moka::cpu {

// The error word: the first failure wins, every wait polls failed().
template <typename Status>
class FirstFailure {
 public:
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void report(const Status& status) {
    std::lock_guard lock(mutex_);
    if (failed_.load(std::memory_order_relaxed)) return;
    status_ = status;
    failed_.store(true, std::memory_order_release);
  }
  Status status() const {
    std::lock_guard lock(mutex_);
    return status_;
  }

 private:
  std::atomic<bool> failed_{false};
  mutable std::mutex mutex_;
  Status status_{};
};

// Acquire polling of `counter` until it reaches `target` (true). Bounded: gives up (false) when
// `failure` is set by another worker, or after `timeout_seconds`, when it reports
// on_timeout(seen) first. The GPU polls relaxed and fences once; ThreadSanitizer does not model
// fences, so the emulation acquires on every load.
template <typename Status, typename OnTimeout>
bool wait_for_counter(const std::atomic<int64_t>& counter, int64_t target, double timeout_seconds,
                      FirstFailure<Status>& failure, OnTimeout&& on_timeout) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  for (;;) {
    const int64_t seen = counter.load(std::memory_order_acquire);
    if (seen >= target) return true;
    if (failure.failed()) return false;
    if (std::chrono::steady_clock::now() > deadline) {
      failure.report(on_timeout(seen));
      return false;
    }
    std::this_thread::yield();
  }
}

// Each counter's value, in index order (after the workers joined).
inline std::vector<int64_t> counter_values(const std::vector<std::atomic<int64_t>>& counters) {
  std::vector<int64_t> values;
  for (const auto& c : counters) values.push_back(c.load(std::memory_order_relaxed));
  return values;
}

inline int world_of(ProcessGroup* group) { return group ? group->size() : 1; }
inline int rank_of(ProcessGroup* group) { return group ? group->rank() : 0; }
inline void barrier(ProcessGroup* group) {
  if (group) group->barrier();
}

// Every rank's `mine` (the addresses of its symmetric buffers), by rank.
template <typename Addresses>
std::vector<Addresses> publish(ProcessGroup* group, const Addresses& mine) {
  std::vector<Addresses> all(world_of(group), mine);
  if (group) group->all_gather(&mine, all.data(), sizeof(mine));
  return all;
}

template <typename T>
constexpr DType emulated_dtype() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}

// What every rank must agree on before the kernel runs (T is float or double).
template <typename T>
core::LayerSignature layer_signature(const MoeShape& s, int64_t tokens) {
  return {tokens,
          s.hidden,
          s.intermediate,
          s.num_experts,
          s.top_k,
          s.shared_intermediate,
          static_cast<int32_t>(emulated_dtype<T>())};
}

// Checks, on every rank together (an error names the failing rank), what both emulations take:
// the shape, the config, the worker count, the layer's inputs, weights and routing; then more().
template <typename T, typename More>
void validate_emulation_inputs(ProcessGroup* group, const MoeShape& shape, const MoeInputs& in, const MoeWeights& w,
                               const core::MegakernelConfig& config, int num_compute_workers, More&& more) {
  const int64_t tokens = in.x.rank == 2 ? in.x.dim(0) : 0;
  core::validate_collectively(group, layer_signature<T>(shape, tokens), [&] {
    core::validate_shape(shape, world_of(group));
    core::validate_megakernel_config(config);
    require(num_compute_workers >= 1, ErrorCode::invalid_argument,
            "megakernel emulation needs at least one compute worker, got " + std::to_string(num_compute_workers));
    core::validate_layer_tensors(shape, world_of(group), in, w, emulated_dtype<T>(), Device::cpu());
    core::validate_routing(in.topk_ids.as<int32_t>(), in.topk_weights.as<T>(), tokens, shape.top_k, shape.num_experts);
    more(tokens);
  });
}

}  // namespace moka::cpu
