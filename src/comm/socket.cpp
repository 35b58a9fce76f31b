#include "comm/socket.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "moka/error.hpp"

namespace moka::comm {
namespace {

// True when fd is ready for `events` within `timeout_s`.
bool ready_within(int fd, short events, double timeout_s) {
  const double deadline = now_seconds() + timeout_s;
  for (;;) {
    const double left = deadline - now_seconds();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min(left, 1.0) * 1000) + 1);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) throw Error(ErrorCode::io, std::string("poll: ") + std::strerror(errno));
  }
}

// Waits until fd is ready for `events` or the deadline passes.
void wait_ready(int fd, short events, double deadline, const std::string& peer, const char* what) {
  if (!ready_within(fd, events, deadline - now_seconds()))
    throw Error(ErrorCode::timeout, peer + " did not answer (" + what + ") in time");
}

sockaddr_in resolve(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), nullptr, &hints, &res);
  require(rc == 0 && res, ErrorCode::invalid_argument, "cannot resolve MASTER_ADDR '" + addr + "'");
  sockaddr_in sa = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  sa.sin_port = htons(static_cast<uint16_t>(port));
  return sa;
}

std::string frame_limit_text() { return std::to_string(kMaxFrameBytes >> 20) + " MiB"; }

}  // namespace

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

Socket::~Socket() { close(); }

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::send_all(const void* data, size_t bytes, const std::string& peer, double deadline) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    wait_ready(fd_, POLLOUT, deadline, peer, "send");
    const ssize_t n = ::send(fd_, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) throw Error(ErrorCode::peer_failure, peer + " closed the connection");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void Socket::recv_all(void* data, size_t bytes, const std::string& peer, double deadline) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    wait_ready(fd_, POLLIN, deadline, peer, "receive");
    const ssize_t n = ::recv(fd_, p, bytes, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) throw Error(ErrorCode::peer_failure, peer + " closed the connection (it stopped or failed)");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void Socket::send_frame(FrameType type, const void* data, size_t bytes, const std::string& peer, double timeout_s) {
  require(bytes <= kMaxFrameBytes, ErrorCode::invalid_argument,
          "a message of " + std::to_string(bytes) + " bytes to " + peer + " is over the TCP group's limit of " +
              frame_limit_text() + " per collective");
  const double deadline = now_seconds() + timeout_s;
  const FrameHeader h{kFrameMagic, static_cast<uint32_t>(type), bytes};
  send_all(&h, sizeof(h), peer, deadline);
  send_all(data, bytes, peer, deadline);
}

Frame Socket::recv_frame(const std::string& peer, double timeout_s) {
  const double deadline = now_seconds() + timeout_s;
  FrameHeader h{};
  recv_all(&h, sizeof(h), peer, deadline);
  require(h.magic == kFrameMagic, ErrorCode::io, peer + " sent data that is not a moka frame (corrupted stream?)");
  require(h.type <= static_cast<uint32_t>(FrameType::stalled), ErrorCode::io,
          peer + " sent a frame of unknown type " + std::to_string(h.type));
  require(h.bytes <= kMaxFrameBytes, ErrorCode::io,
          peer + " announced a frame of " + std::to_string(h.bytes) + " bytes, over the limit of " +
              frame_limit_text() + " (corrupted stream?)");
  Frame f;
  f.type = static_cast<FrameType>(h.type);
  // Grown as bytes arrive, so a peer that announces more than it sends costs no more memory
  // than it sent.
  constexpr size_t kChunk = size_t{1} << 22;
  for (size_t got = 0; got < h.bytes;) {
    const size_t n = std::min<size_t>(h.bytes - got, kChunk);
    f.payload.resize(got + n);
    recv_all(f.payload.data() + got, n, peer, deadline);
    got += n;
  }
  return f;
}

bool Socket::readable_within(double timeout_s) { return ready_within(fd_, POLLIN, timeout_s); }

Socket listen_on(const std::string& addr, int port) {
  Socket s(::socket(AF_INET, SOCK_STREAM, 0));
  require(s.valid(), ErrorCode::io, std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa = resolve(addr, port);
  if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0)
    throw Error(ErrorCode::io, "cannot listen on " + addr + ":" + std::to_string(port) + ": " + std::strerror(errno));
  require(::listen(s.fd(), 1024) == 0, ErrorCode::io, std::string("listen: ") + std::strerror(errno));
  return s;
}

Socket accept_one(Socket& listener) {
  Socket s(::accept(listener.fd(), nullptr, nullptr));
  require(s.valid(), ErrorCode::io, std::string("accept: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return s;
}

std::string peer_name(const Socket& s) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (::getpeername(s.fd(), reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "an unknown address";
  char ip[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(sa.sin_port));
}

void close_gracefully(Socket& s, double timeout_s) {
  if (!s.valid()) return;
  ::shutdown(s.fd(), SHUT_WR);
  const double deadline = now_seconds() + timeout_s;
  char discard[4096];
  while (s.readable_within(deadline - now_seconds()) && ::recv(s.fd(), discard, sizeof(discard), 0) > 0) {
  }
  s.close();
}

Socket connect_to(const std::string& addr, int port, double timeout_s) {
  const double deadline = now_seconds() + timeout_s;
  const sockaddr_in sa = resolve(addr, port);
  for (;;) {
    Socket s(::socket(AF_INET, SOCK_STREAM, 0));
    require(s.valid(), ErrorCode::io, std::string("socket: ") + std::strerror(errno));
    if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) == 0) {
      const int one = 1;
      ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return s;
    }
    if (now_seconds() > deadline)
      throw Error(ErrorCode::timeout, "rank 0 at " + addr + ":" + std::to_string(port) + " is not reachable");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 may not listen yet
  }
}

int pick_free_port() {
  Socket s = listen_on("127.0.0.1", 0);
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&sa), &len);
  return ntohs(sa.sin_port);
}

}  // namespace moka::comm
