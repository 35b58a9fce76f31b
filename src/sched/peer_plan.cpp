#include "sched/peer_plan.hpp"

#include <algorithm>
#include <numeric>
#include <queue>

#include "moka/error.hpp"

namespace moka::sched {

std::vector<int> split_workers(const std::vector<int64_t>& bytes, int workers) {
  const int peers = static_cast<int>(bytes.size());
  std::vector<int> share(peers, 0);
  const auto active = std::count_if(bytes.begin(), bytes.end(), [](int64_t b) { return b > 0; });
  require(workers >= active, ErrorCode::invalid_argument,
          "split_workers: " + std::to_string(workers) + " workers for " + std::to_string(active) + " peers with bytes");
  const __int128 total = std::accumulate(bytes.begin(), bytes.end(), __int128{0});
  if (total == 0) return share;
  const int spare = workers - static_cast<int>(active);
  std::vector<std::pair<__int128, int>> remainders;  // (remainder, peer)
  int given = 0;
  for (int p = 0; p < peers; ++p) {
    if (bytes[p] <= 0) continue;
    const __int128 scaled = static_cast<__int128>(spare) * bytes[p];
    share[p] = 1 + static_cast<int>(scaled / total);
    given += share[p];
    remainders.emplace_back(scaled % total, p);
  }
  std::sort(remainders.begin(), remainders.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  for (int k = 0; given < workers; ++k, ++given) ++share[remainders[k].second];
  return share;
}

std::vector<int64_t> chunks_per_peer(const std::vector<int64_t>& bytes, int64_t chunk_bytes) {
  require(chunk_bytes > 0, ErrorCode::invalid_argument, "chunk size must be positive");
  std::vector<int64_t> chunks(bytes.size());
  for (size_t p = 0; p < bytes.size(); ++p) chunks[p] = (bytes[p] + chunk_bytes - 1) / chunk_bytes;
  return chunks;
}

namespace {

// Peers in staggered order self+1, self+2, ..., self.
std::vector<int> staggered_peers(int peers, int self) {
  std::vector<int> order(peers);
  for (int s = 0; s < peers; ++s) order[s] = (self + 1 + s) % peers;
  return order;
}

std::vector<PeerChunk> round_robin_order(const std::vector<int64_t>& chunks, int self) {
  std::vector<PeerChunk> out;
  std::vector<int> active;
  for (int p : staggered_peers(static_cast<int>(chunks.size()), self))
    if (chunks[p] > 0) active.push_back(p);
  for (int64_t round = 0; !active.empty(); ++round) {
    for (int p : active) out.push_back({p, round});
    std::erase_if(active, [&](int p) { return chunks[p] == round + 1; });
  }
  return out;
}

// k-way merge by virtual finish time (index + 1) / chunks, compared exactly in integers.
std::vector<PeerChunk> rate_based_order(const std::vector<int64_t>& chunks, int self) {
  const int peers = static_cast<int>(chunks.size());
  std::vector<int> rank_of_peer(peers);
  const auto stagger = staggered_peers(peers, self);
  for (int s = 0; s < peers; ++s) rank_of_peer[stagger[s]] = s;
  const auto later = [&](const PeerChunk& a, const PeerChunk& b) {
    const __int128 fa = static_cast<__int128>(a.index + 1) * chunks[b.peer];
    const __int128 fb = static_cast<__int128>(b.index + 1) * chunks[a.peer];
    return fa != fb ? fa > fb : rank_of_peer[a.peer] > rank_of_peer[b.peer];
  };
  std::priority_queue<PeerChunk, std::vector<PeerChunk>, decltype(later)> due(later);
  for (int p = 0; p < peers; ++p)
    if (chunks[p] > 0) due.push({p, 0});
  std::vector<PeerChunk> out;
  out.reserve(std::accumulate(chunks.begin(), chunks.end(), int64_t{0}));
  while (!due.empty()) {
    const PeerChunk next = due.top();
    due.pop();
    out.push_back(next);
    if (next.index + 1 < chunks[next.peer]) due.push({next.peer, next.index + 1});
  }
  return out;
}

}  // namespace

std::vector<PeerChunk> chunk_order(const std::vector<int64_t>& chunks, int self, ChunkOrder order) {
  return order == ChunkOrder::rate_based ? rate_based_order(chunks, self) : round_robin_order(chunks, self);
}

RankPlan plan_rank(const std::vector<int64_t>& counts, int world, int rank, int workers, int64_t chunk,
                   ChunkOrder order) {
  require(static_cast<int64_t>(counts.size()) == static_cast<int64_t>(world) * world, ErrorCode::shape_mismatch,
          "plan_rank: counts must be world x world");
  require(rank >= 0 && rank < world, ErrorCode::invalid_argument, "plan_rank: rank out of range");
  std::vector<int64_t> row(counts.begin() + static_cast<int64_t>(rank) * world,
                           counts.begin() + static_cast<int64_t>(rank + 1) * world);
  row[rank] = 0;  // local rows never cross the fabric
  return {split_workers(row, workers), chunk_order(chunks_per_peer(row, chunk), rank, order)};
}

}  // namespace moka::sched
