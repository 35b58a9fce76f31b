// The routing schedule: which (source rank, token, k-slot) rows a rank receives for its local
// experts, and where each row sits in the rank's expert-grouped buffer. Plain C++ shared by the
// CPU reference and the CUDA kernels (the placement rule is MOKA_HD).
//
// Layout of one receiving rank's grouped buffer:
//   local expert 0's rows, padded up to a multiple of tile_rows; then expert 1's; ...
// Inside an expert's segment the rows from different source ranks are interleaved (RowOrder in
// moka/config.hpp): round-robin (source 0's first route, source 1's first, ..., then every
// source's second, ...; sources that run out are skipped) or rate-based (merged by virtual
// finish time), so one tile reads from many peers. A source's routes to one expert keep their
// slot order (slot = token * k + j). Padding rows have slot -1.
#pragma once
#include <cstdint>
#include <vector>

#include "core/hd.hpp"
#include "moka/config.hpp"

namespace moka::core {

struct ScheduleDims {
  int world_size = 1;
  int64_t tokens_per_rank = 0;  // T (equal on every rank)
  int64_t top_k = 0;
  int64_t num_local_experts = 0;
  int64_t first_local_expert = 0;  // global id of local expert 0
  int64_t tile_rows = 128;
  RowOrder row_order = RowOrder::round_robin;
  int rank = 0;  // the receiving rank (rate-based ties are staggered from it)
};

MOKA_HD int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Position, inside its expert's segment, of the `index`-th route from `source` to an expert
// whose per-source route counts are counts[0..world_size). Round-robin interleave: all rows of
// smaller index from every source come first, then sources before `source` that still have a
// row at `index`.
MOKA_HD int64_t interleaved_position(const int64_t* counts, int world_size, int source, int64_t index) {
  int64_t pos = 0;
  for (int r = 0; r < world_size; ++r) {
    const int64_t c = counts[r];
    pos += c < index ? c : index;
    if (r < source && c > index) ++pos;
  }
  return pos;
}

// Position of the `index`-th route from `source` when the sources' routes are merged by virtual
// finish time (index + 1) / counts[source], compared exactly as (i + 1) * c' vs (i' + 1) * c;
// equal times go to sources in staggered order receiver+1, receiver+2, ... (as
// sched::chunk_order's rate-based merge, which the tests compare it with).
MOKA_HD int64_t rate_based_position(const int64_t* counts, int world_size, int receiver, int source, int64_t index) {
  const int64_t c = counts[source];
  const int source_turn = (source - receiver - 1 + 2 * world_size) % world_size;
  int64_t pos = 0;
  for (int r = 0; r < world_size; ++r) {
    const int64_t cr = counts[r];
    if (cr == 0) continue;
    const int64_t scaled = (index + 1) * cr;   // (i' + 1) * c < scaled: due earlier
    const int64_t earlier = (scaled - 1) / c;  // number of i' + 1 values strictly below
    pos += earlier < cr ? earlier : cr;
    const int turn = (r - receiver - 1 + 2 * world_size) % world_size;
    if (r != source && scaled % c == 0 && scaled / c <= cr && turn < source_turn) ++pos;  // tie
  }
  return pos;
}

// The position rule `dims.row_order` selects.
MOKA_HD int64_t row_position(const ScheduleDims& dims, const int64_t* counts, int source, int64_t index) {
  return dims.row_order == RowOrder::rate_based ? rate_based_position(counts, dims.world_size, dims.rank, source, index)
                                                : interleaved_position(counts, dims.world_size, source, index);
}

struct ReceiveSchedule {
  ScheduleDims dims;
  std::vector<int64_t> counts;         // [E_local][world_size] routes per (expert, source)
  std::vector<int64_t> expert_rows;    // [E_local] real rows
  std::vector<int64_t> expert_offset;  // [E_local + 1] padded segment starts; back() = total
  std::vector<int32_t> row_source;     // [total] source rank, -1 for padding
  std::vector<int64_t> row_slot;       // [total] token*k + j at the source, -1 for padding
  // [E_local] rows of each expert sorted by (source, slot): the canonical order every
  // cross-row reduction (weight gradients) uses, so results do not depend on world_size.
  std::vector<std::vector<int64_t>> canonical_rows;

  int64_t total_rows() const { return expert_offset.back(); }
  int64_t count(int64_t local_expert, int source) const { return counts[local_expert * dims.world_size + source]; }
  // Local expert owning a row of the grouped buffer.
  int64_t expert_of_row(int64_t row) const;
};

// all_topk_ids: [world_size][T][k] global expert ids of every rank (already validated).
ReceiveSchedule build_receive_schedule(const ScheduleDims& dims, const int32_t* all_topk_ids);

// The order in which a source rank sends its routes: grouped by destination rank, then by
// expert, then by slot. This equals the order the receivers list that source's rows in their
// schedules, so a plain all-to-all-v of rows in this order lands every row on its own.
struct SendPlan {
  std::vector<int64_t> slots;        // all T*k slots in send order
  std::vector<int64_t> rank_offset;  // [world_size + 1] slice of `slots` for each destination
};
SendPlan build_send_plan(const int32_t* topk_ids, int64_t tokens, int64_t top_k, int64_t num_experts, int world_size);

// For a receiving rank: the row of its grouped buffer that holds the n-th route received from
// `source` (in that source's send order). [world_size][...].
std::vector<std::vector<int64_t>> rows_by_source(const ReceiveSchedule& schedule);

}  // namespace moka::core
