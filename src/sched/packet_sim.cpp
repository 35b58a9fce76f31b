#include "sched/packet_sim.hpp"

#include <algorithm>
#include <deque>
#include <limits>
#include <numeric>
#include <set>
#include <queue>

#include "moka/error.hpp"
#include "sched/peer_plan.hpp"

namespace moka::sched {

BackPressure parse_back_pressure(const std::string& name) {
  if (name == "credit") return BackPressure::credit;
  if (name == "pfc") return BackPressure::pfc;
  throw Error(ErrorCode::invalid_argument, "unknown back-pressure '" + name + "' (credit, pfc)");
}

namespace {

struct Chunk {
  int dst = 0;
  int phase = 0;
  int64_t bytes = 0;
  double release = 0;  // earliest start, relative to the opening of its phase
};

// Row i of `d` as chunks in `order`. With pace_span > 0 each chunk is released at the moment
// the constant-rate fluid schedule (D_ij / pace_span) starts sending its bytes, so no flow runs
// ahead of its rate by more than one chunk.
void append_ordered(std::vector<Chunk>& out, const TrafficMatrix& d, int i, ChunkOrder order, int64_t chunk, int phase,
                    double pace_span) {
  std::vector<int64_t> row(d.bytes.begin() + static_cast<int64_t>(i) * d.n,
                           d.bytes.begin() + static_cast<int64_t>(i + 1) * d.n);
  for (const PeerChunk& pc : chunk_order(chunks_per_peer(row, chunk), i, order)) {
    const int64_t before = pc.index * chunk;
    const double release = pace_span * static_cast<double>(before) / static_cast<double>(row[pc.peer]);
    out.push_back({pc.peer, phase, std::min(chunk, row[pc.peer] - before), release});
  }
}

void append_flow(std::vector<Chunk>& out, int dst, int64_t bytes, int64_t chunk, int phase) {
  for (int64_t sent = 0; sent < bytes; sent += chunk) out.push_back({dst, phase, std::min(chunk, bytes - sent), 0.0});
}

// Every sender's chunk sequence under policy p; returns the number of phases (1 if unphased).
int build_chunks(Policy p, const TrafficMatrix& d, const Fabric& f, const PolicyOptions& o, int64_t chunk,
                 std::vector<std::vector<Chunk>>& out) {
  out.assign(d.n, {});
  switch (p) {
    case Policy::rate_based:
    case Policy::round_robin: {
      const bool paced = p == Policy::rate_based;
      const double span = paced ? lower_bound(d, f).seconds : 0.0;
      for (int i = 0; i < d.n; ++i)
        append_ordered(out[i], d, i, paced ? ChunkOrder::rate_based : ChunkOrder::round_robin, chunk, 0, span);
      return 1;
    }
    case Policy::destination_major:
    case Policy::spreadout:
      for (int i = 0; i < d.n; ++i)
        for (int j : destination_order(p, d, i)) append_flow(out[i], j, d.at(i, j), chunk, 0);
      return 1;
    case Policy::spreadout_barrier:
    case Policy::bvn:
    case Policy::greedy_matching: {
      TrafficMatrix residual;
      const auto phases = policy_phases(p, d, o, residual);
      for (size_t k = 0; k < phases.size(); ++k)
        for (int i = 0; i < d.n; ++i)
          if (phases[k].bytes_of[i] > 0)
            append_flow(out[i], phases[k].receiver_of[i], phases[k].bytes_of[i], chunk, static_cast<int>(k));
      const double tail = lower_bound(residual, f).seconds;
      if (tail == 0) return static_cast<int>(phases.size());
      for (int i = 0; i < d.n; ++i)
        append_ordered(out[i], residual, i, ChunkOrder::rate_based, chunk, static_cast<int>(phases.size()), tail);
      return static_cast<int>(phases.size()) + 1;
    }
    case Policy::max_min_fair: break;
  }
  throw Error(ErrorCode::invalid_argument, to_string(p) + " has no packet-level model (fluid only)");
}

class PacketSim {
 public:
  PacketSim(const TrafficMatrix& d, const Fabric& f, const PacketOptions& o, std::vector<std::vector<Chunk>> chunks,
            int phases, double barrier_s)
      : d_(d), f_(f), o_(o), n_(d.n), chunks_(std::move(chunks)), barrier_s_(barrier_s), senders_(n_),
        link_busy_(n_, false), pause_count_(n_, 0), stalled_since_(n_, -1), next_wake_(n_, -1),
        credits_(n_, credit_mode() ? o.buffer_bytes : std::numeric_limits<double>::infinity()),
        waiting_(static_cast<size_t>(n_) * n_, 0), waiters_(n_), ports_(n_),
        queued_from_(static_cast<size_t>(n_) * n_, 0), phase_left_(phases, 0), phase_open_at_(phases, 0) {
    for (int i = 0; i < n_; ++i) {
      auto& by_release = senders_[i].by_release;
      by_release.resize(chunks_[i].size());
      std::iota(by_release.begin(), by_release.end(), int64_t{0});
      std::stable_sort(by_release.begin(), by_release.end(), [&](int64_t a, int64_t b) {
        const Chunk &ca = chunks_[i][a], &cb = chunks_[i][b];
        return ca.phase != cb.phase ? ca.phase < cb.phase : ca.release < cb.release;
      });
      for (const Chunk& c : chunks_[i]) ++phase_left_[c.phase];
    }
  }

  SimResult run() {
    open_phase(0);
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      now_ = e.time;
      handle(e);
    }
    return result();
  }

 private:
  enum class Kind : uint8_t { wake, send_done, arrive, port_done, credit, pause, resume, phase_open };
  struct Event {
    double time;
    uint64_t seq;
    Kind kind;
    int a;      // sender, port or phase
    int b;      // sender of an arriving chunk
    int64_t k;  // chunk index within its sender
    bool operator>(const Event& o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };
  struct Sender {
    std::vector<int64_t> by_release;  // chunk indices by (phase, release)
    int64_t fed = 0;                  // by_release[0, fed) have been made ready
    std::set<int64_t> ready;          // released, unsent chunks by their position in the order
  };
  struct Port {
    std::deque<std::pair<int, int64_t>> fifo;  // (sender, chunk)
    double bytes = 0, peak = 0, integral = 0, last_change = 0;
    bool busy = false, pausing = false;
    std::vector<int> paused;
  };

  void schedule(double t, Kind kind, int a, int b = 0, int64_t k = 0) { events_.push({t, seq_++, kind, a, b, k}); }
  const Chunk& chunk(int i, int64_t k) const { return chunks_[i][k]; }

  void handle(const Event& e) {
    switch (e.kind) {
      case Kind::wake: try_send(e.a); break;
      case Kind::send_done:
        link_busy_[e.a] = false;
        schedule(now_ + o_.propagation_s, Kind::arrive, chunk(e.a, e.k).dst, e.a, e.k);
        try_send(e.a);
        break;
      case Kind::arrive: arrive(e.a, e.b, e.k); break;
      case Kind::port_done: port_done(e.a); break;
      case Kind::credit:
        credits_[e.a] += static_cast<double>(e.k);
        wake_waiters(e.a);
        break;
      case Kind::pause: ++pause_count_[e.a]; break;
      case Kind::resume:
        --pause_count_[e.a];
        try_send(e.a);
        break;
      case Kind::phase_open: open_phase(e.a); break;
    }
  }

  void open_phase(int phase) {
    open_phase_ = phase;
    phase_open_at_[phase] = now_;
    for (int i = 0; i < n_; ++i) try_send(i);
  }

  bool credit_mode() const { return o_.mode == BackPressure::credit && o_.buffer_bytes > 0; }

  // Moves sender i's chunks whose phase is open and release time has come into its ready set.
  void release_due(int i) {
    Sender& s = senders_[i];
    for (; s.fed < static_cast<int64_t>(s.by_release.size()); ++s.fed) {
      const int64_t k = s.by_release[s.fed];
      const Chunk& c = chunks_[i][k];
      if (c.phase > open_phase_) return;
      const double release = phase_open_at_[c.phase] + c.release;
      if (release > now_) {
        if (next_wake_[i] <= now_ || release < next_wake_[i]) next_wake_[i] = release, schedule(release, Kind::wake, i);
        return;
      }
      s.ready.insert(k);
    }
  }

  // The first ready chunk, in the policy's order, that sender i may start now, or -1; sets
  // `blocked` when back-pressure (a pause, or missing credits) is what stops it.
  int64_t pick_chunk(int i, bool& blocked) {
    release_due(i);
    auto& ready = senders_[i].ready;
    if (ready.empty()) return -1;
    if (pause_count_[i] > 0) return blocked = true, -1;
    const int lookahead = credit_mode() ? n_ : 1;
    int examined = 0;
    for (auto it = ready.begin(); it != ready.end() && examined < lookahead; ++it, ++examined) {
      const Chunk& c = chunks_[i][*it];
      if (credits_[c.dst] >= static_cast<double>(c.bytes)) {
        const int64_t k = *it;
        ready.erase(it);
        return k;
      }
      blocked = true;
      char& registered = waiting_[static_cast<size_t>(c.dst) * n_ + i];
      if (!registered) registered = 1, waiters_[c.dst].push_back(i);
    }
    return -1;
  }

  void try_send(int i) {
    if (link_busy_[i]) return;
    bool blocked = false;
    const int64_t k = pick_chunk(i, blocked);
    if (k < 0) {
      if (blocked && stalled_since_[i] < 0) stalled_since_[i] = now_;
      return;
    }
    if (stalled_since_[i] >= 0) pause_s_ += now_ - stalled_since_[i], stalled_since_[i] = -1;
    const Chunk& c = chunks_[i][k];
    link_busy_[i] = true;
    credits_[c.dst] -= static_cast<double>(c.bytes);
    schedule(now_ + static_cast<double>(c.bytes) / f_.send_bw_of(i), Kind::send_done, i, 0, k);
  }

  void wake_waiters(int port) {
    std::vector<int> waiting;
    waiting.swap(waiters_[port]);
    for (int i : waiting) waiting_[static_cast<size_t>(port) * n_ + i] = 0;
    for (int i : waiting) try_send(i);
  }

  void change_occupancy(int j, double delta) {
    Port& p = ports_[j];
    p.integral += p.bytes * (now_ - p.last_change);
    p.last_change = now_;
    p.bytes += delta;
    p.peak = std::max(p.peak, p.bytes);
    if (o_.series_points > 1) log_.push_back({now_, j, p.bytes});
  }

  void arrive(int j, int src, int64_t k) {
    Port& p = ports_[j];
    p.fifo.emplace_back(src, k);
    ++queued_from_[static_cast<size_t>(j) * n_ + src];
    change_occupancy(j, static_cast<double>(chunk(src, k).bytes));
    if (o_.mode == BackPressure::pfc && o_.buffer_bytes > 0 && !p.pausing && p.bytes >= o_.buffer_bytes) {
      p.pausing = true;
      for (int i = 0; i < n_; ++i)
        if (queued_from_[static_cast<size_t>(j) * n_ + i] > 0)
          p.paused.push_back(i), schedule(now_ + o_.propagation_s, Kind::pause, i);
    }
    if (!p.busy) start_port(j);
  }

  void start_port(int j) {
    Port& p = ports_[j];
    if (p.fifo.empty()) return;
    p.busy = true;
    const auto [src, k] = p.fifo.front();
    schedule(now_ + static_cast<double>(chunk(src, k).bytes) / f_.recv_bw_of(j), Kind::port_done, j);
  }

  void port_done(int j) {
    Port& p = ports_[j];
    const auto [src, k] = p.fifo.front();
    p.fifo.pop_front();
    p.busy = false;
    --queued_from_[static_cast<size_t>(j) * n_ + src];
    const Chunk& c = chunk(src, k);
    change_occupancy(j, -static_cast<double>(c.bytes));
    const double delivered = now_ + o_.propagation_s;
    completion_ = std::max(completion_, delivered);
    if (--phase_left_[c.phase] == 0 && c.phase + 1 < static_cast<int>(phase_left_.size()))
      schedule(delivered + barrier_s_, Kind::phase_open, c.phase + 1);
    if (credit_mode()) schedule(delivered, Kind::credit, j, 0, c.bytes);
    if (p.pausing && p.bytes <= 0.5 * o_.buffer_bytes) {
      p.pausing = false;
      for (int i : p.paused) schedule(delivered, Kind::resume, i);
      p.paused.clear();
    }
    start_port(j);
  }

  SimResult result() {
    SimResult r;
    r.tstar_s = lower_bound(d_, f_).seconds;
    r.hot_receiver = hottest_receiver(d_, f_);
    r.completion_s = completion_;
    r.pause_s = pause_s_;
    r.phases = static_cast<int>(phase_left_.size());
    for (Port& p : ports_) {
      r.peak_queue.push_back(p.peak);
      r.mean_queue.push_back(completion_ > 0 ? p.integral / completion_ : 0);
    }
    if (o_.series_points > 1) sample_series(r);
    return r;
  }

  void sample_series(SimResult& r) const {
    std::vector<double> occupancy(n_, 0);
    size_t next = 0;
    for (int s = 0; s < o_.series_points; ++s) {
      const double t = completion_ * s / (o_.series_points - 1);
      for (; next < log_.size() && log_[next].time <= t; ++next) occupancy[log_[next].port] = log_[next].bytes;
      r.series_times.push_back(t);
      r.series.push_back(occupancy);
    }
  }

  struct QueueLog {
    double time;
    int port;
    double bytes;
  };

  const TrafficMatrix& d_;
  const Fabric& f_;
  const PacketOptions& o_;
  int n_;
  std::vector<std::vector<Chunk>> chunks_;
  double barrier_s_;
  std::vector<Sender> senders_;
  std::vector<bool> link_busy_;
  std::vector<int> pause_count_;
  std::vector<double> stalled_since_, next_wake_, credits_;
  std::vector<char> waiting_;  // [port][sender]: sender is in waiters_[port]
  std::vector<std::vector<int>> waiters_;
  std::vector<Port> ports_;
  std::vector<int> queued_from_;  // [port][sender]: chunks of sender in the port's FIFO
  std::vector<int64_t> phase_left_;
  std::vector<double> phase_open_at_;
  std::vector<QueueLog> log_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  uint64_t seq_ = 0;
  double now_ = 0, completion_ = 0, pause_s_ = 0;
  int open_phase_ = 0;
};

}  // namespace

SimResult simulate_packets(Policy p, const TrafficMatrix& d, const Fabric& f, const PolicyOptions& policy,
                           const PacketOptions& o) {
  require(d.n == f.gpus, ErrorCode::shape_mismatch, "traffic matrix and fabric disagree on the GPU count");
  require(o.chunk_bytes > 0 && o.buffer_bytes >= 0 && o.propagation_s >= 0, ErrorCode::invalid_argument,
          "chunk size must be positive, buffer and propagation delay non-negative");
  require(o.mode == BackPressure::pfc || o.buffer_bytes == 0 || o.buffer_bytes >= static_cast<double>(o.chunk_bytes),
          ErrorCode::invalid_argument, "a credit buffer must hold at least one chunk");
  std::vector<std::vector<Chunk>> chunks;
  const int phases = build_chunks(p, d, f, policy, o.chunk_bytes, chunks);
  SimResult r = PacketSim(d, f, o, std::move(chunks), std::max(phases, 1), policy.barrier_s).run();
  r.policy = to_string(p);
  return r;
}

}  // namespace moka::sched
