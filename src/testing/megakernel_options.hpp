// The options of a megakernel-path layer with the given knobs (its tile and row order included),
// for up to `max_tokens` tokens per rank: what the GPU tests, `moka bench` and `moka tune` build.
#pragma once
#include <cstdint>

#include "moka/layer.hpp"

namespace moka::fixtures {

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
