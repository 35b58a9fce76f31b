// A minimal deterministic parallel-for: work items are split into contiguous chunks; each item
// is computed by exactly one thread, so results never depend on the thread count.
#pragma once
#include <cstdint>
#include <functional>

namespace moka::cpu {

// Calls fn(begin, end) over [0, n) on up to `threads` threads (0 = hardware concurrency).
void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn);
int resolve_threads(int requested, int world_size);

}  // namespace moka::cpu
