// Reader of routing dumps (`moka bench --dump-routing`, JSON lines read by `moka simulate
// --replay`): one epoch per line, every rank's top-k expert ids and the shape they route over.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moka::sched {

struct RoutingEpoch {
  std::string shape;  // the named shape, "" when the line has none
  int top_k = 0;
  int num_experts = 0;
  int64_t hidden = 0;
  std::vector<std::vector<int32_t>> topk_ids;  // [rank][tokens * top_k], equal tokens on every rank
};

// Every non-empty line of the dump at `path`, checked: a line that is not JSON, misses a field,
// has a field of the wrong type or out of range (top_k 0, ids outside the experts, ranks that
// disagree on the token count, ...) throws moka::Error naming the file, the line and the field.
std::vector<RoutingEpoch> read_routing_dump(const std::string& path);

}  // namespace moka::sched
