#include "core/exchange_blocks.hpp"

#include "core/schedule.hpp"

namespace moka::core {

ExchangeBlocks plan_exchange_blocks(const int32_t* sent_per_expert, const int32_t* received, int world,
                                    int64_t local_experts, int64_t tile_rows) {
  ExchangeBlocks b;
  const int64_t El = local_experts, E = El * world;
  int64_t first = 0;
  for (int64_t e = 0; e < E; ++e) {
    b.sends.push_back({static_cast<int>(e / El), first, sent_per_expert[e]});
    first += sent_per_expert[e];
  }
  b.expert_rows.assign(El, 0);
  b.expert_offset.assign(El + 1, 0);
  for (int64_t e = 0; e < El; ++e) {
    int64_t row = b.expert_offset[e];
    for (int src = 0; src < world; ++src) {
      b.receives.push_back({src, row, received[src * El + e]});
      row += received[src * El + e];
    }
    b.expert_rows[e] = row - b.expert_offset[e];
    b.expert_offset[e + 1] = b.expert_offset[e] + round_up(b.expert_rows[e], tile_rows);
  }
  return b;
}

}  // namespace moka::core
