#pragma once
#include <memory>

#include "moka/layer.hpp"
#include "moka/router.hpp"

namespace moka::cpu {

std::unique_ptr<MoeLayer> make_cpu_moe_layer(const MoeShape& shape, ProcessGroup* group, const LayerOptions& options);
std::unique_ptr<Router> make_cpu_router(const RouterConfig& config, const LayerOptions& options);

}  // namespace moka::cpu
