// ProcessGroup over TCP between processes: a star around rank 0, which relays every collective.
// Host-side collectives here are small (routing, validation, NCCL ids, CPU-backend rows), so a
// relay is simple and fast enough; GPU data moves over NCCL and NVLink, never through this.
#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/socket.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"

namespace moka {
namespace {

using comm::Frame;
using comm::FrameType;
using comm::Socket;

struct Hello {
  int32_t rank;
  int32_t world_size;
};

class TcpGroup final : public ProcessGroup {
 public:
  explicit TcpGroup(const Rendezvous& rv) : rank_(rv.rank), size_(rv.world_size), timeout_(rv.timeout_seconds) {
    peers_.resize(size_);
    if (size_ == 1) return;
    if (rank_ == 0) {
      accept_peers(rv);
    } else {
      peers_[0] = comm::connect_to(rv.master_addr, rv.master_port, timeout_);
      const Hello hello{rank_, size_};
      peers_[0].send_frame(FrameType::data, &hello, sizeof(hello), "rank 0", timeout_);
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
      require(all.size() == bytes * size_, ErrorCode::shape_mismatch, "all_gather: ranks gave different sizes");
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
    } else {
      std::vector<std::vector<char>> from(size_);
      from[0] = mine;
      for (int p = 1; p < size_; ++p) from[p] = receive_from(p);
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
    send_abort("rank " + std::to_string(rank_) + " failed: " + reason, -1);
  }

 private:
  static std::string name(int r) { return "rank " + std::to_string(r); }

  void accept_peers(const Rendezvous& rv) {
    Socket listener = comm::listen_on(rv.master_addr, rv.master_port);
    for (int n = 1; n < size_; ++n) {
      Socket s = comm::accept_one(listener, timeout_);
      const Frame f = s.recv_frame("a connecting rank", timeout_);
      Hello hello{};
      require(f.payload.size() == sizeof(hello), ErrorCode::io, "bad hello from a connecting rank");
      std::memcpy(&hello, f.payload.data(), sizeof(hello));
      require(hello.world_size == size_, ErrorCode::shape_mismatch,
              "rank " + std::to_string(hello.rank) + " has WORLD_SIZE " + std::to_string(hello.world_size) +
                  ", rank 0 has " + std::to_string(size_));
      require(hello.rank > 0 && hello.rank < size_ && !peers_[hello.rank].valid(), ErrorCode::invalid_argument,
              "rank " + std::to_string(hello.rank) + " is out of range or joined twice");
      peers_[hello.rank] = std::move(s);
    }
  }

  // Tells every peer but `except` why the job stops; peers that are gone are skipped.
  void send_abort(const std::string& msg, int except) {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || p == except || !peers_[p].valid()) continue;
      try {
        peers_[p].send_frame(FrameType::abort, msg.data(), msg.size(), name(p), 2.0);
      } catch (const Error&) {
      }
    }
  }

  // A data frame from `p`; an abort frame becomes peer_failure here (rank 0 passes it on).
  std::vector<char> receive_from(int p) {
    Frame f = peers_[p].recv_frame(name(p), timeout_);
    if (f.type == FrameType::abort) {
      const std::string reason(f.payload.begin(), f.payload.end());
      if (rank_ == 0 && !aborted_) {
        aborted_ = true;
        send_abort(reason, p);
      }
      throw Error(ErrorCode::peer_failure, reason);
    }
    return std::move(f.payload);
  }

  static uint64_t segment_bytes(const char* header, int q) {
    uint64_t b;
    std::memcpy(&b, header + q * sizeof(uint64_t), sizeof(b));
    return b;
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
  double timeout_;
  std::vector<Socket> peers_;
  bool aborted_ = false;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

const char* first_env(std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (const char* v = std::getenv(n); v && *v) return n;
  return nullptr;
}

}  // namespace

Rendezvous rendezvous_from_env() {
  Rendezvous rv;
  const char* rank_var = first_env({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"});
  const char* size_var = first_env({"WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"});
  const char* local_var = first_env({"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"});
  rv.world_size = size_var ? env_int(size_var, 1) : 0;
  rv.rank = rank_var ? env_int(rank_var, 0) : 0;
  rv.local_rank = local_var ? env_int(local_var, 0) : rv.rank;
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) rv.master_addr = a;
  rv.master_port = env_int("MASTER_PORT", rv.master_port);
  if (const char* t = std::getenv("MOKA_COMM_TIMEOUT_S"); t && *t) rv.timeout_seconds = std::atof(t);
  if (rv.world_size > 0) {
    require(rv.rank >= 0 && rv.rank < rv.world_size, ErrorCode::invalid_argument,
            "RANK " + std::to_string(rv.rank) + " is outside [0, WORLD_SIZE=" + std::to_string(rv.world_size) + ")");
  }
  return rv;
}

bool launched_as_worker() { return rendezvous_from_env().world_size > 1; }

std::unique_ptr<ProcessGroup> make_tcp_group(const Rendezvous& rv) {
  require(rv.world_size >= 1, ErrorCode::invalid_argument, "world size must be >= 1");
  return std::make_unique<TcpGroup>(rv);
}

}  // namespace moka
