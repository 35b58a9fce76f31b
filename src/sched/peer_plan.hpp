// Per-rank plan for the expert-parallel exchange: how a rank's communication workers (CTAs,
// warps or threads) split over its peers, and in which order it pushes or pulls chunks.
//
// Every rank knows the whole (sender, receiver) count matrix of a layer after the routing
// exchange, so each computes its own plan locally: the functions are pure and deterministic
// (same inputs, same plan on every rank and every run; integers only, no floating point).
// Plain C++, callable from CUDA host code; the plan changes only who moves which chunk when,
// never the data, so results stay bitwise identical.
//
// Why: equal workers per peer let the cold flows finish first, after which the hot peer's
// flow runs on a fraction of the workers and the tail grows (round-robin incast). Workers in
// proportion to bytes, and chunks merged by virtual finish time (chunk c of a flow of n chunks
// is due at (c + 1) / n of the epoch), keep every flow's rate at its bytes / T*: all flows
// finish together and no receiver gets more than it drains.
#pragma once
#include <cstdint>
#include <vector>

namespace moka::sched {

enum class ChunkOrder : uint8_t {
  rate_based,   // merge by virtual finish time (default)
  round_robin,  // one chunk per peer that still has chunks, in turn
};

struct PeerChunk {
  int peer = 0;
  int64_t index = 0;  // chunk number within the flow to `peer`
  bool operator==(const PeerChunk&) const = default;
};

// Workers per peer, summing to `workers`: one for every peer with bytes, the rest in proportion
// to bytes by largest remainder (ties to the lower peer index); peers without bytes get none.
// Requires workers >= the number of peers with bytes (throws invalid_argument otherwise).
std::vector<int> split_workers(const std::vector<int64_t>& bytes_to_peer, int workers);

// Chunks of ceil(bytes / chunk_bytes) per peer.
std::vector<int64_t> chunks_per_peer(const std::vector<int64_t>& bytes_to_peer, int64_t chunk_bytes);

// Processing order of all chunks of rank `self`. Ties (equal finish times, or the start of a
// round) go to peers in staggered order self+1, self+2, ... so that ranks do not all start on
// the same receiver.
std::vector<PeerChunk> chunk_order(const std::vector<int64_t>& chunks_to_peer, int self, ChunkOrder order);

// The plan of `rank` from the row-major world x world matrix `counts` (bytes, or rows: only
// ratios matter for the split; `chunk` is in the same unit).
struct RankPlan {
  std::vector<int> workers_per_peer;
  std::vector<PeerChunk> order;
};
RankPlan plan_rank(const std::vector<int64_t>& counts, int world, int rank, int workers, int64_t chunk,
                   ChunkOrder order = ChunkOrder::rate_based);

}  // namespace moka::sched
