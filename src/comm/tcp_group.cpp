// ProcessGroup over TCP between processes: a star around rank 0, which relays every collective.
// Host-side collectives here are small (routing, validation, NCCL ids, CPU-backend rows), so a
// relay is simple and fast enough; GPU data moves over NCCL and NVLink, never through this.
// Everything read from the wire is checked before use: a corrupted or hostile peer gets an
// Error naming it, never a read past a buffer.
// Joining: rank 0 sends every connection a fresh 32-byte challenge; a rank answers with its
// Hello, whose proof is HMAC-SHA256(job key, kHelloLabel | challenge | rank | world size). Rank 0
// drops (and reports) a connection that proves nothing within kHandshakeSeconds, sends anything
// else, or claims a taken rank, and goes on waiting for the real ranks; it listens until every
// rank is in, so the port is never free for someone else to take while ranks still join, and
// each rank's traffic then stays on the connection it authenticated. Without a key (loopback, or
// allow_unauthenticated) the proof is not checked.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>

#include "comm/auth.hpp"
#include "comm/socket.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"

namespace moka {
namespace {

using comm::Frame;
using comm::FrameType;
using comm::Socket;

// Far above any real job (rank 0 holds one socket per rank); bounds what a corrupted
// environment or hello can make rank 0 allocate.
constexpr int kMaxWorldSize = 1 << 16;
// How often a waiting rank reports progress and rank 0 tells the others whom it waits for.
constexpr double kMaxReportInterval = 10.0;

struct Hello {
  int32_t rank;
  int32_t world_size;
  comm::Digest proof;  // zeros without a job key
};
constexpr size_t kChallengeBytes = 32;
constexpr char kHelloLabel[] = "moka-tcp-hello-1";
// How long a new connection may take to answer the challenge: a rank answers at once, so this
// only bounds how long a silent stranger holds up the rendezvous.
constexpr double kHandshakeSeconds = 5.0;
constexpr size_t kMinKeyBytes = 16;

comm::Digest hello_proof(const std::string& key, const std::vector<char>& challenge, int32_t rank, int32_t world) {
  std::string text(kHelloLabel, sizeof(kHelloLabel));  // the label and its terminating zero
  text.append(challenge.data(), challenge.size());
  for (int32_t v : {rank, world})
    for (int b = 0; b < 4; ++b) text.push_back(static_cast<char>(uint32_t(v) >> (8 * b)));
  return comm::hmac_sha256(key, std::vector<uint8_t>(text.begin(), text.end()));
}

// A rendezvous without a key only on loopback (or when the user opts out), and a key long
// enough to guess no faster than the HMAC.
void check_authentication(const Rendezvous& rv) {
  if (!rv.job_key.empty()) {
    require(rv.job_key.size() >= kMinKeyBytes, ErrorCode::invalid_argument,
            "the job key (MOKA_JOB_KEY) has " + std::to_string(rv.job_key.size()) + " bytes; it needs at least " +
                std::to_string(kMinKeyBytes) + " (moka launch makes 64 hex digits)");
    return;
  }
  require(rv.world_size == 1 || rv.allow_unauthenticated || comm::is_loopback(rv.master_addr),
          ErrorCode::invalid_argument,
          "no job key for a rendezvous at " + rv.master_addr +
              ", which other machines may reach: anyone who connects could join the job or stop it. Give every "
              "rank the same secret in MOKA_JOB_KEY (or a file named by MOKA_JOB_KEY_FILE), or set "
              "MOKA_ALLOW_UNAUTHENTICATED=1 to run without one");
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

class TcpGroup final : public ProcessGroup {
 public:
  explicit TcpGroup(const Rendezvous& rv)
      : rank_(rv.rank), size_(rv.world_size), timeout_(rv.timeout_seconds),
        report_every_(std::min(kMaxReportInterval, rv.timeout_seconds / 4)) {
    peers_.resize(size_);
    job_key_ = rv.job_key;
    if (size_ == 1) return;
    check_authentication(rv);
    if (rank_ == 0) {
      accept_peers(rv);
    } else {
      join(rv);
    }
  }
  ~TcpGroup() override = default;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    char* out = static_cast<char*>(recv);
    if (size_ == 1) {
      std::memcpy(out, send, bytes);
      return;
    }
    if (rank_ != 0) {
      peers_[0].send_frame(FrameType::data, send, bytes, "rank 0", timeout_);
      const auto all = receive_from(0);
      require(all.size() == bytes * size_, ErrorCode::shape_mismatch,
              "all_gather: rank 0 relayed " + std::to_string(all.size()) + " bytes, " + name(rank_) + " expected " +
                  std::to_string(size_) + " x " + std::to_string(bytes));
      std::memcpy(out, all.data(), all.size());
      return;
    }
    std::memcpy(out, send, bytes);
    for (int p = 1; p < size_; ++p) {
      const auto part = receive_from(p);
      require(part.size() == bytes, ErrorCode::shape_mismatch,
              "all_gather: rank " + std::to_string(p) + " sent " + std::to_string(part.size()) +
                  " bytes, rank 0 expected " + std::to_string(bytes));
      std::memcpy(out + p * bytes, part.data(), bytes);
    }
    for (int p = 1; p < size_; ++p) peers_[p].send_frame(FrameType::data, out, bytes * size_, name(p), timeout_);
  }

  // Wire format of one rank's contribution and of what a rank receives alike:
  // size_ x uint64 byte counts (per destination, or per source), then the segments in order.
  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override {
    const auto mine = pack(static_cast<const char*>(send), send_bytes, send_offsets);
    std::vector<char> incoming;
    if (size_ == 1) {
      incoming = mine;
    } else if (rank_ != 0) {
      peers_[0].send_frame(FrameType::data, mine.data(), mine.size(), "rank 0", timeout_);
      incoming = receive_from(0);
      check_segments(incoming, 0);
    } else {
      std::vector<std::vector<char>> from(size_);
      from[0] = mine;
      for (int p = 1; p < size_; ++p) {
        from[p] = receive_from(p);
        check_segments(from[p], p);
      }
      for (int d = size_ - 1; d >= 0; --d) {
        auto routed = route_to(from, d);
        if (d == 0) incoming = std::move(routed);
        else peers_[d].send_frame(FrameType::data, routed.data(), routed.size(), name(d), timeout_);
      }
    }
    unpack(incoming, static_cast<char*>(recv), recv_bytes, recv_offsets);
  }

  void barrier() override {
    const char token = 1;
    std::vector<char> all(size_);
    all_gather(&token, all.data(), 1);
  }

  void abort(const std::string& reason) override {
    if (aborted_ || size_ == 1) return;
    aborted_ = true;
    notify_peers(FrameType::abort, "rank " + std::to_string(rank_) + " failed: " + reason, -1);
  }

 private:
  static std::string name(int r) { return "rank " + std::to_string(r); }

  // One bounded wait: its start, its deadline (a `waiting` notice from rank 0 moves it) and
  // when it next reports progress.
  struct Wait {
    double start, deadline, next_report;
  };
  Wait begin_wait() const {
    const double now = comm::now_seconds();
    return Wait{now, now + timeout_, now + report_every_};
  }

  // Waits until `s` is readable or the deadline passes (false), calling report(seconds waited)
  // every report_every_ seconds meanwhile.
  bool await_readable(Socket& s, Wait& w, const std::function<void(double)>& report) const {
    for (;;) {
      const double now = comm::now_seconds();
      if (now >= w.deadline) return false;
      if (now >= w.next_report) {
        report(now - w.start);
        w.next_report = comm::now_seconds() + report_every_;
      }
      if (s.readable_within(std::min(w.deadline, w.next_report) - comm::now_seconds())) return true;
    }
  }

  void report_progress(const std::string& what, double waited) const {
    std::fprintf(stderr, "moka: rank %d waiting for %s (%s of MOKA_COMM_TIMEOUT_S=%s) ...\n", rank_, what.c_str(),
                 seconds_text(waited).c_str(), seconds_text(timeout_).c_str());
  }

  int first_missing_rank() const {
    int r = 1;
    while (peers_[r].valid()) ++r;
    return r;
  }

  std::string missing_ranks() const {
    std::string out;
    int missing = 0;
    for (int r = 1; r < size_; ++r) {
      if (peers_[r].valid()) continue;
      if (++missing <= 8) out += (out.empty() ? "" : ", ") + std::to_string(r);
    }
    if (missing > 8) out += " and " + std::to_string(missing - 8) + " more";
    return (missing == 1 ? "rank " : "ranks ") + out;
  }

  // A rank other than 0: connect, answer rank 0's challenge with this rank's proof. A refusal
  // (another key) comes back as an abort frame at the first collective.
  void join(const Rendezvous& rv) {
    peers_[0] = comm::connect_to(rv.master_addr, rv.master_port, timeout_);
    const Frame challenge = peers_[0].recv_frame("rank 0", timeout_);
    require(challenge.type == FrameType::data && challenge.payload.size() == kChallengeBytes, ErrorCode::io,
            "rank 0 at " + rv.master_addr + ":" + std::to_string(rv.master_port) +
                " did not send a moka challenge (another program on that port, or a moka without authentication?)");
    Hello hello{rank_, size_, {}};
    if (!rv.job_key.empty()) hello.proof = hello_proof(rv.job_key, challenge.payload, rank_, size_);
    peers_[0].send_frame(FrameType::data, &hello, sizeof(hello), "rank 0", timeout_);
  }

  // Rank 0: one connection's challenge and hello. The rank it proves to be, or -1 when it is
  // dropped (reported on stderr): it answered nothing, something else, a wrong proof or a taken
  // rank. A proven rank with another world size stops the job (a misconfiguration, not a
  // stranger).
  int admit(Socket& s, const std::string& from) {
    std::string why;
    try {
      const std::vector<uint8_t> nonce = comm::random_bytes(kChallengeBytes);
      const std::vector<char> challenge(nonce.begin(), nonce.end());
      const double handshake = std::min(timeout_, kHandshakeSeconds);
      s.send_frame(FrameType::data, challenge.data(), challenge.size(), from, handshake);
      if (!s.readable_within(handshake)) {
        why = "it sent no hello within " + seconds_text(handshake);
      } else {
        const Frame f = s.recv_frame(from, handshake);
        Hello hello{};
        if (f.type != FrameType::data || f.payload.size() != sizeof(hello)) {
          why = "it sent no moka hello (" + std::to_string(f.payload.size()) + " bytes)";
        } else {
          std::memcpy(&hello, f.payload.data(), sizeof(hello));
          const bool proven =
              job_key_.empty() ||
              comm::digests_equal(hello.proof, hello_proof(job_key_, challenge, hello.rank, hello.world_size));
          if (!proven) {
            why = "its proof of the job key is wrong (every rank needs the same MOKA_JOB_KEY)";
          } else if (hello.world_size != size_) {
            throw Error(ErrorCode::shape_mismatch, "rank " + std::to_string(hello.rank) + " has WORLD_SIZE " +
                                                       std::to_string(hello.world_size) + ", rank 0 has " +
                                                       std::to_string(size_));
          } else if (hello.rank <= 0 || hello.rank >= size_ || peers_[hello.rank].valid()) {
            why = "it claims rank " + std::to_string(hello.rank) + ", which is out of range or already in";
          } else {
            return hello.rank;
          }
        }
      }
    } catch (const Error& e) {
      if (e.code() == ErrorCode::shape_mismatch) throw;
      why = comm::printable(e.what(), 200);
    }
    std::fprintf(stderr, "moka: rank 0 dropped a connection from %s: %s\n", from.c_str(), why.c_str());
    const std::string refusal = "rank 0 refused this connection: " + why;
    try {
      s.send_frame(FrameType::abort, refusal.data(), refusal.size(), from, 1.0);
      comm::close_gracefully(s, 1.0);  // the refusal reaches a rank that already sent more
    } catch (const Error&) {
    }
    return -1;
  }

  void accept_peers(const Rendezvous& rv) {
    Socket listener = comm::listen_on(rv.master_addr, rv.master_port);
    Wait wait = begin_wait();
    for (int joined = 1; joined < size_; ++joined) {
      const bool arrived = await_readable(listener, wait, [&](double waited) {
        notify_waiting_for(first_missing_rank());
        report_progress(missing_ranks() + " to connect", waited);
      });
      if (!arrived)
        give_up(missing_ranks() + " did not connect to rank 0 at " + rv.master_addr + ":" +
                std::to_string(rv.master_port) + " within MOKA_COMM_TIMEOUT_S=" + seconds_text(timeout_));
      Socket s = comm::accept_one(listener);
      const int rank = admit(s, comm::peer_name(s));
      if (rank < 0) {
        --joined;  // a stranger: still waiting for as many ranks
        continue;
      }
      peers_[rank] = std::move(s);
    }
  }

  // Tells every peer but `except` (and this rank) something; best effort: a peer that is gone
  // is skipped, since its own connection reports it.
  void notify_peers(FrameType type, const std::string& payload, int except) {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || p == except || !peers_[p].valid()) continue;
      try {
        peers_[p].send_frame(type, payload.data(), payload.size(), name(p), 2.0);
      } catch (const Error&) {
      }
    }
  }

  // The next data frame from `p`. While rank 0 waits for a peer it tells the others whom it waits
  // for (which restarts their deadline: rank 0 is alive), so everybody names the rank that
  // stalled; when that rank stays silent past the timeout, rank 0 tells everybody it stalled.
  // An abort frame becomes peer_failure (rank 0 passes it on), a stalled frame a timeout.
  std::vector<char> receive_from(int p) {
    Wait wait = begin_wait();
    int rank_0_waits_for = -1;  // what rank 0 last said it waits for
    const auto report = [&](double waited) {
      if (rank_ == 0) {
        notify_waiting_for(p);
        report_progress(name(p), waited);
      } else if (rank_0_waits_for > 0) {
        report_progress(name(rank_0_waits_for) + ", relayed by rank 0", waited);
      } else {
        report_progress("rank 0", waited);
      }
    };
    for (;;) {
      if (!await_readable(peers_[p], wait, report)) throw_silent(p, rank_0_waits_for);
      Frame f = peers_[p].recv_frame(name(p), timeout_);
      if (f.type == FrameType::data) return std::move(f.payload);
      if (f.type == FrameType::abort) {
        // Printable, and attributed to the rank whose connection carried it (rank 0 relays:
        // what it passes on is already attributed).
        std::string reason = comm::printable(std::string(f.payload.begin(), f.payload.end()));
        if (rank_ == 0 && reason.rfind(name(p) + " ", 0) != 0) reason = name(p) + " reports: " + reason;
        if (rank_ == 0 && !aborted_) {
          aborted_ = true;
          notify_peers(FrameType::abort, reason, p);
        }
        throw Error(ErrorCode::peer_failure, reason);
      }
      require(rank_ != 0, ErrorCode::io, name(p) + " sent a frame only rank 0 sends (corrupted stream?)");
      if (f.type == FrameType::stalled)
        throw Error(ErrorCode::timeout, comm::printable(std::string(f.payload.begin(), f.payload.end())));
      rank_0_waits_for = waited_rank(f);
      wait.deadline = comm::now_seconds() + timeout_;
    }
  }

  // Rank 0 tells the others whom it waits for: they keep waiting and can name that rank.
  void notify_waiting_for(int p) {
    const int32_t who = p;
    notify_peers(FrameType::waiting, std::string(reinterpret_cast<const char*>(&who), sizeof(who)), p);
  }

  int waited_rank(const Frame& waiting) const {
    int32_t r = -1;
    if (waiting.payload.size() == sizeof(r)) std::memcpy(&r, waiting.payload.data(), sizeof(r));
    require(r > 0 && r < size_ && r != rank_, ErrorCode::io, "rank 0 sent a malformed waiting notice");
    return r;
  }

  // `p` sent nothing within the timeout. Rank 0 knows `p` is the one that stalled and tells
  // everybody; the others blame rank 0 only when rank 0 itself went silent.
  [[noreturn]] void throw_silent(int p, int rank_0_waits_for) {
    const std::string silent = name(p) + " sent nothing for MOKA_COMM_TIMEOUT_S=" + seconds_text(timeout_);
    if (rank_ == 0) give_up(silent + " in a collective: it stalled or was stopped");
    throw Error(ErrorCode::timeout,
                silent + (rank_0_waits_for > 0 ? " (it last said it waits for " + name(rank_0_waits_for) + ")"
                                               : ": it stalled or was stopped"));
  }

  // Rank 0 stops waiting for a rank: every peer (the stalled one too, should it wake up) gets
  // the reason as its timeout error.
  [[noreturn]] void give_up(const std::string& reason) {
    if (!aborted_) {
      aborted_ = true;
      notify_peers(FrameType::stalled, reason, -1);
    }
    throw Error(ErrorCode::timeout, reason);
  }

  static uint64_t segment_bytes(const char* header, int q) {
    uint64_t b;
    std::memcpy(&b, header + q * sizeof(uint64_t), sizeof(b));
    return b;
  }

  // An all-to-all message must be a table of size_ segment sizes followed by exactly those
  // segments; route_to and unpack rely on it.
  void check_segments(const std::vector<char>& msg, int sender) const {
    const size_t table = size_ * sizeof(uint64_t);
    require(msg.size() >= table, ErrorCode::io,
            "all_to_all_v: " + name(sender) + " sent " + std::to_string(msg.size()) +
                " bytes, fewer than its table of " + std::to_string(size_) + " segment sizes");
    uint64_t left = msg.size() - table;
    for (int q = 0; q < size_; ++q) {
      const uint64_t b = segment_bytes(msg.data(), q);
      require(b <= left, ErrorCode::io,
              "all_to_all_v: " + name(sender) + " lists a segment of " + std::to_string(b) + " bytes for " + name(q) +
                  " but only " + std::to_string(left) + " bytes follow");
      left -= b;
    }
    require(left == 0, ErrorCode::io,
            "all_to_all_v: " + name(sender) + " sent " + std::to_string(left) +
                " bytes more than its segment table lists");
  }

  std::vector<char> pack(const char* data, const size_t* bytes, const size_t* offsets) const {
    size_t total = 0;
    for (int p = 0; p < size_; ++p) total += bytes[p];
    std::vector<char> out(size_ * sizeof(uint64_t) + total);
    char* cursor = out.data() + size_ * sizeof(uint64_t);
    for (int p = 0; p < size_; ++p) {
      const uint64_t b = bytes[p];
      std::memcpy(out.data() + p * sizeof(uint64_t), &b, sizeof(b));
      std::memcpy(cursor, data + offsets[p], bytes[p]);
      cursor += bytes[p];
    }
    return out;
  }

  // What destination d receives: the segment every source addressed to it, in source order.
  std::vector<char> route_to(const std::vector<std::vector<char>>& from, int d) const {
    std::vector<char> out(size_ * sizeof(uint64_t));
    for (int s = 0; s < size_; ++s) {
      const char* header = from[s].data();
      const char* seg = header + size_ * sizeof(uint64_t);
      for (int q = 0; q < d; ++q) seg += segment_bytes(header, q);
      const uint64_t b = segment_bytes(header, d);
      std::memcpy(out.data() + s * sizeof(uint64_t), &b, sizeof(b));
      out.insert(out.end(), seg, seg + b);
    }
    return out;
  }

  void unpack(const std::vector<char>& in, char* recv, const size_t* recv_bytes, const size_t* recv_offsets) const {
    const char* cursor = in.data() + size_ * sizeof(uint64_t);
    for (int s = 0; s < size_; ++s) {
      const uint64_t b = segment_bytes(in.data(), s);
      require(b == recv_bytes[s], ErrorCode::shape_mismatch,
              "all_to_all_v: rank " + std::to_string(s) + " sends " + std::to_string(b) + " bytes to rank " +
                  std::to_string(rank_) + ", which expects " + std::to_string(recv_bytes[s]));
      std::memcpy(recv + recv_offsets[s], cursor, b);
      cursor += b;
    }
  }

  int rank_, size_;
  double timeout_, report_every_;
  std::vector<Socket> peers_;
  std::string job_key_;  // empty: proofs not checked
  bool aborted_ = false;
};

// The value of environment variable `name`; nullptr when unset or empty (both mean "not set").
const char* env_value(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// The first of `names` that is set.
const char* first_env(std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (env_value(n)) return n;
  return nullptr;
}

// `name`'s value as an integer in [lo, hi]: the whole value must be the number; `bound`
// explains where hi comes from, if anywhere.
int env_int(const char* name, int lo, int hi, const std::string& bound = "") {
  const std::string v = env_value(name);
  int out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  require(ec != std::errc::invalid_argument && end == v.data() + v.size(), ErrorCode::invalid_argument,
          std::string(name) + "='" + v + "' is not an integer");
  require(ec == std::errc() && out >= lo && out <= hi, ErrorCode::invalid_argument,
          std::string(name) + "=" + v + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" + bound);
  return out;
}

}  // namespace

Rendezvous rendezvous_from_env() {
  Rendezvous rv;
  const char* rank_var = first_env({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"});
  const char* size_var = first_env({"WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"});
  const char* local_var = first_env({"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"});
  rv.world_size = size_var ? env_int(size_var, 1, kMaxWorldSize) : 0;
  const int max_rank = size_var ? rv.world_size - 1 : kMaxWorldSize - 1;
  const std::string rank_bound =
      size_var ? std::string(" (") + size_var + "=" + std::to_string(rv.world_size) + ")" : "";
  rv.rank = rank_var ? env_int(rank_var, 0, max_rank, rank_bound) : 0;
  rv.local_rank = local_var ? env_int(local_var, 0, max_rank, rank_bound) : rv.rank;
  if (const char* a = env_value("MASTER_ADDR")) rv.master_addr = a;
  if (env_value("MASTER_PORT")) rv.master_port = env_int("MASTER_PORT", 1, 65535);
  if (const char* t = env_value("MOKA_COMM_TIMEOUT_S")) {
    double v = 0;
    const char* end = t + std::strlen(t);
    const auto [parsed_end, ec] = std::from_chars(t, end, v);
    require(ec == std::errc() && parsed_end == end && std::isfinite(v) && v > 0, ErrorCode::invalid_argument,
            std::string("MOKA_COMM_TIMEOUT_S='") + t + "' is not a positive number of seconds");
    rv.timeout_seconds = v;
  }
  if (const char* key = env_value("MOKA_JOB_KEY")) {
    rv.job_key = key;
  } else if (const char* file = env_value("MOKA_JOB_KEY_FILE")) {
    std::ifstream in(file);
    require(in.good(), ErrorCode::invalid_argument, std::string("MOKA_JOB_KEY_FILE=") + file + " cannot be read");
    std::getline(in, rv.job_key);
    require(!rv.job_key.empty(), ErrorCode::invalid_argument,
            std::string("MOKA_JOB_KEY_FILE=") + file + " has no key on its first line");
  }
  if (const char* allow = env_value("MOKA_ALLOW_UNAUTHENTICATED")) {
    require(std::string(allow) == "0" || std::string(allow) == "1", ErrorCode::invalid_argument,
            std::string("MOKA_ALLOW_UNAUTHENTICATED='") + allow + "' is neither 0 nor 1");
    rv.allow_unauthenticated = std::string(allow) == "1";
  }
  return rv;
}

bool launched_as_worker() { return rendezvous_from_env().world_size > 1; }

std::unique_ptr<ProcessGroup> make_tcp_group(const Rendezvous& rv) {
  require(rv.world_size >= 1 && rv.world_size <= kMaxWorldSize, ErrorCode::invalid_argument,
          "world size " + std::to_string(rv.world_size) + " is outside [1, " + std::to_string(kMaxWorldSize) + "]");
  require(rv.rank >= 0 && rv.rank < rv.world_size, ErrorCode::invalid_argument,
          "rank " + std::to_string(rv.rank) + " is outside [0, " + std::to_string(rv.world_size - 1) + "]");
  require(rv.master_port >= 1 && rv.master_port <= 65535, ErrorCode::invalid_argument,
          "master port " + std::to_string(rv.master_port) + " is outside [1, 65535]");
  require(std::isfinite(rv.timeout_seconds) && rv.timeout_seconds > 0, ErrorCode::invalid_argument,
          "the TCP group's timeout must be a positive number of seconds");
  return std::make_unique<TcpGroup>(rv);
}

}  // namespace moka
