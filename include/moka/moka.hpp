// moka: Mixture-of-Experts layers for NVLink-connected Hopper GPUs. Umbrella header.
#pragma once
#include "moka/config.hpp"
#include "moka/error.hpp"
#include "moka/layer.hpp"
#include "moka/process_group.hpp"
#include "moka/router.hpp"
#include "moka/stream.hpp"
#include "moka/tensor.hpp"

namespace moka {
const char* build_commit();  // git commit the library was built from
}
