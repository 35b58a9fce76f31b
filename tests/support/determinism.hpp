// Determinism checks that can fail: a computation is run once on the calling thread and then
// several times at once on fresh threads, each building its inputs anew. Hidden shared state (a
// static or global RNG, a data race, leftovers of an earlier call, an address-dependent order)
// makes the runs disagree.
#pragma once
#include <future>
#include <latch>
#include <vector>

namespace moka::testing {

// The results of `compute()`: [0] from this thread, then one per concurrent thread.
template <class Compute>
auto concurrent_runs(Compute compute, int threads = 4) {
  std::vector<decltype(compute())> results;
  results.push_back(compute());
  std::latch start(threads);
  std::vector<std::future<decltype(compute())>> runs;
  for (int t = 0; t < threads; ++t)
    runs.push_back(std::async(std::launch::async, [&] {
      start.arrive_and_wait();
      return compute();
    }));
  for (auto& run : runs) results.push_back(run.get());
  return results;
}

}  // namespace moka::testing
