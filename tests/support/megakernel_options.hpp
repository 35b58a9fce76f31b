// The options of a megakernel-path layer with the given knobs (its tile and row order included),
// for up to `max_tokens` tokens per rank: what the GPU tests build.
#pragma once
#include <cstdint>
#include <cstdlib>

#include "moka/layer.hpp"

namespace moka::fixtures {

// The megakernels' wait bound in the GPU tests: 2 s, so a hang fails fast (a pipeline wait gives
// up after 3 s, a task-queue wait after 6 s); MOKA_TEST_SPIN_TIMEOUT_S lengthens it where
// kernels run far slower (compute-sanitizer: bench/sanitize_gpu.sh).
inline double test_spin_timeout() {
  const char* v = std::getenv("MOKA_TEST_SPIN_TIMEOUT_S");
  const double seconds = v ? std::atof(v) : 2.0;
  return seconds > 0 ? seconds : 2.0;
}

inline LayerOptions megakernel_options(const MegakernelConfig& c, int64_t max_tokens) {
  LayerOptions o;
  o.path = LayerPath::megakernel;
  o.max_tokens = max_tokens;
  o.megakernel = c;
  o.tile_rows = c.tile_rows;
  o.row_order = c.row_order;
  return o;
}

}  // namespace moka::fixtures
