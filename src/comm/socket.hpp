// Framed, deadline-bounded TCP messages (POSIX sockets) for the host-side process group.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moka::comm {

enum class FrameType : uint32_t { data = 0, abort = 1 };

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

  // Throw Error(peer_failure) on a closed connection and Error(timeout) past the deadline;
  // `peer` names the other side in the message.
  void send_frame(FrameType type, const void* data, size_t bytes, const std::string& peer, double timeout_s);
  Frame recv_frame(const std::string& peer, double timeout_s);

 private:
  void send_all(const void* data, size_t bytes, const std::string& peer, double deadline);
  void recv_all(void* data, size_t bytes, const std::string& peer, double deadline);
  int fd_ = -1;
};

Socket listen_on(const std::string& addr, int port);          // bound, listening socket
Socket accept_one(Socket& listener, double timeout_s);
Socket connect_to(const std::string& addr, int port, double timeout_s);  // retries until the deadline
int pick_free_port();

}  // namespace moka::comm
