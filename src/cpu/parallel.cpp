#include "cpu/parallel.hpp"

#include <algorithm>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

namespace moka::cpu {

int resolve_threads(int requested, int world_size) {
  if (requested > 0) return requested;
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, hw / std::max(1, world_size));
}

void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(std::max(1, threads), n);
  if (workers == 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers);  // so that emplace_back can fail only at starting a thread
  std::vector<std::exception_ptr> errors(workers);
  const int64_t chunk = (n + workers - 1) / workers;
  bool can_start_threads = true;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t b = w * chunk, e = std::min(n, b + chunk);
    if (b >= e) break;
    const auto run_chunk = [&, w, b, e] {
      try {
        fn(b, e);
      } catch (...) {
        errors[w] = std::current_exception();
      }
    };
    if (can_start_threads) {
      try {
        pool.emplace_back(run_chunk);
        continue;
      } catch (const std::system_error&) {
        // The limit on processes and threads (ulimit -u) is reached, as when many emulated ranks
        // each start a pool: this thread computes the chunks left, the same chunks as a thread would.
        can_start_threads = false;
      }
    }
    run_chunk();
  }
  for (auto& t : pool) t.join();
  for (auto& err : errors)
    if (err) std::rethrow_exception(err);
}

}  // namespace moka::cpu
