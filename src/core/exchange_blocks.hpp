// The block lists of the expert-parallel all-to-all path (plain C++; the CUDA exchange hands
// them to NCCL). A rank sends its slots sorted by global expert, so its rows for expert e are one
// contiguous run; the owner receives each (source, expert) run straight into the expert's
// segment of its grouped buffer, sources in rank order, segments padded to the tile. Both sides
// list the runs of a rank pair in expert order, so the n-th send from a to b matches the n-th
// receive on b from a, which is how NCCL pairs point-to-point operations.
#pragma once
#include <cstdint>
#include <vector>

namespace moka::core {

struct TransferBlock {
  int peer = 0;
  int64_t first = 0;  // first row in the local buffer (send-ordered buffer or grouped buffer)
  int64_t rows = 0;
};

struct ExchangeBlocks {
  std::vector<TransferBlock> sends;     // runs of the send-ordered buffer, expert by expert
  std::vector<TransferBlock> receives;  // runs of the grouped buffer, expert by expert, then by source
  std::vector<int64_t> expert_rows;     // [E_local] real rows
  std::vector<int64_t> expert_offset;   // [E_local + 1] padded segment starts
};

// sent_per_expert: [E] this rank's routes per global expert; received: [world][E_local] routes
// each source sends to this rank's experts (the exchanged count table).
ExchangeBlocks plan_exchange_blocks(const int32_t* sent_per_expert, const int32_t* received, int world,
                                    int64_t local_experts, int64_t tile_rows);

}  // namespace moka::core
