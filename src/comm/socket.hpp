// Framed, deadline-bounded TCP messages (POSIX sockets) for the host-side process group.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moka::comm {

// data: a collective's payload. abort: a rank failed (payload: the reason). waiting: rank 0 is
// still waiting for a peer (payload: that rank, int32). stalled: rank 0 gave up on a peer that
// stopped answering (payload: the reason).
enum class FrameType : uint32_t { data = 0, abort = 1, waiting = 2, stalled = 3 };

// Every frame starts with this header; `magic` tells a moka rank from anything else that
// connects to the port, and `bytes` (at most kMaxFrameBytes) is the payload that follows.
struct FrameHeader {
  uint32_t magic;
  uint32_t type;
  uint64_t bytes;
};
inline constexpr uint32_t kFrameMagic = 0x414b4f4d;  // "MOKA" in little-endian memory order
// Host collectives carry routing, ids and CPU-backend rows; a larger length means a corrupted
// stream, and is refused before anything is allocated for it.
inline constexpr uint64_t kMaxFrameBytes = uint64_t{1} << 30;

struct Frame {
  FrameType type = FrameType::data;
  std::vector<char> payload;
};

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket();

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void close();

  // Throw Error(peer_failure) on a closed connection, Error(timeout) past the deadline and
  // Error(io) on a frame that breaks the format (bad magic, unknown type, oversized length);
  // `peer` names the other side in the message.
  void send_frame(FrameType type, const void* data, size_t bytes, const std::string& peer, double timeout_s);
  Frame recv_frame(const std::string& peer, double timeout_s);
  // True when data (or a closed connection) is ready to read within `timeout_s`.
  bool readable_within(double timeout_s);

 private:
  void send_all(const void* data, size_t bytes, const std::string& peer, double deadline);
  void recv_all(void* data, size_t bytes, const std::string& peer, double deadline);
  int fd_ = -1;
};

Socket listen_on(const std::string& addr, int port);  // bound, listening socket
Socket accept_one(Socket& listener);                  // blocks until a connection arrives (see readable_within)
std::string peer_name(const Socket& s);               // "ADDRESS:PORT" of the other end, for messages
// Closes `s` after its last frame reached the peer: shuts down this side, then discards what the
// peer still sends until it closes or `timeout_s` passes. A plain close with the peer's data
// unread resets the connection, and a reset can discard the last frame before the peer reads it.
void close_gracefully(Socket& s, double timeout_s);
Socket connect_to(const std::string& addr, int port, double timeout_s);  // retries until the deadline
int pick_free_port();
double now_seconds();  // steady clock

}  // namespace moka::comm
