#include "core/schedule.hpp"

#include <algorithm>

namespace moka::core {

int64_t ReceiveSchedule::expert_of_row(int64_t row) const {
  const auto it = std::upper_bound(expert_offset.begin(), expert_offset.end(), row);
  return static_cast<int64_t>(it - expert_offset.begin()) - 1;
}

ReceiveSchedule build_receive_schedule(const ScheduleDims& dims, const int32_t* all_topk_ids) {
  ReceiveSchedule s;
  s.dims = dims;
  const int R = dims.world_size;
  const int64_t E = dims.num_local_experts;
  const int64_t slots = dims.tokens_per_rank * dims.top_k;
  s.counts.assign(E * R, 0);

  // Count routes per (local expert, source).
  for (int src = 0; src < R; ++src) {
    const int32_t* ids = all_topk_ids + src * slots;
    for (int64_t slot = 0; slot < slots; ++slot) {
      const int64_t e = ids[slot] - dims.first_local_expert;
      if (e >= 0 && e < E) ++s.counts[e * R + src];
    }
  }
  // Pad each expert's rows to the tile so no tile spans two experts.
  s.expert_rows.assign(E, 0);
  s.expert_offset.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    for (int src = 0; src < R; ++src) s.expert_rows[e] += s.counts[e * R + src];
    s.expert_offset[e + 1] = s.expert_offset[e] + round_up(s.expert_rows[e], dims.tile_rows);
  }
  // Place every route with the shared interleave rule.
  s.row_source.assign(s.total_rows(), -1);
  s.row_slot.assign(s.total_rows(), -1);
  std::vector<int64_t> seen(E * R, 0);
  for (int src = 0; src < R; ++src) {
    const int32_t* ids = all_topk_ids + src * slots;
    for (int64_t slot = 0; slot < slots; ++slot) {
      const int64_t e = ids[slot] - dims.first_local_expert;
      if (e < 0 || e >= E) continue;
      const int64_t index = seen[e * R + src]++;
      const int64_t row = s.expert_offset[e] + row_position(dims, &s.counts[e * R], src, index);
      s.row_source[row] = src;
      s.row_slot[row] = slot;
    }
  }
  // Canonical (source, slot) order per expert for order-fixed reductions: source by source, the
  // index-th route of a source sits where the row-order rule put it (no sort needed).
  s.canonical_rows.assign(E, {});
  for (int64_t e = 0; e < E; ++e) {
    auto& rows = s.canonical_rows[e];
    rows.reserve(s.expert_rows[e]);
    for (int src = 0; src < R; ++src)
      for (int64_t index = 0; index < s.counts[e * R + src]; ++index)
        rows.push_back(s.expert_offset[e] + row_position(dims, &s.counts[e * R], src, index));
  }
  return s;
}

SendPlan build_send_plan(const int32_t* topk_ids, int64_t tokens, int64_t top_k, int64_t num_experts, int world_size) {
  const int64_t slots = tokens * top_k;
  // Counting sort by expert keeps slot order inside an expert; experts are contiguous per
  // rank, so this also groups by destination.
  std::vector<int64_t> expert_start(num_experts + 1, 0);
  for (int64_t s = 0; s < slots; ++s) ++expert_start[topk_ids[s] + 1];
  for (int64_t e = 0; e < num_experts; ++e) expert_start[e + 1] += expert_start[e];
  SendPlan plan;
  plan.slots.resize(slots);
  std::vector<int64_t> cursor(expert_start.begin(), expert_start.end() - 1);
  for (int64_t s = 0; s < slots; ++s) plan.slots[cursor[topk_ids[s]]++] = s;
  const int64_t per_rank = num_experts / world_size;
  plan.rank_offset.resize(world_size + 1);
  for (int r = 0; r <= world_size; ++r) plan.rank_offset[r] = expert_start[r * per_rank];
  return plan;
}

std::vector<std::vector<int64_t>> rows_by_source(const ReceiveSchedule& schedule) {
  const int R = schedule.dims.world_size;
  std::vector<std::vector<int64_t>> rows(R);
  // A source sends expert by expert, slot-ordered; inside an expert segment that source's rows
  // appear in the same order, so walking the segments in order reproduces its send order.
  for (int64_t e = 0; e < schedule.dims.num_local_experts; ++e) {
    for (int64_t r = schedule.expert_offset[e]; r < schedule.expert_offset[e + 1]; ++r) {
      if (schedule.row_source[r] >= 0) rows[schedule.row_source[r]].push_back(r);
    }
  }
  return rows;
}

}  // namespace moka::core
