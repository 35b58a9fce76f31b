// The TCP rendezvous against strangers (issue 32): a job with a key admits only ranks that prove
// they hold it; a connection that closes, sends garbage, stays silent, forges or replays a hello
// is dropped and reported, and the job goes on with its real ranks; a stranger racing for the
// port gets nothing. Ranks are threads here, on loopback; the strangers speak the wire format by
// hand.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <latch>
#include <thread>

#include "comm/auth.hpp"
#include "comm/socket.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"

using namespace moka;

namespace {

const std::string kKey = "0123456789abcdef0123456789abcdef";

// The hello of the wire format (tcp_group.cpp): rank, world size, proof.
struct WireHello {
  int32_t rank;
  int32_t world_size;
  std::array<uint8_t, 32> proof;
};

Rendezvous rendezvous(int rank, int port, const std::string& key, double timeout = 20) {
  Rendezvous rv;
  rv.rank = rank;
  rv.world_size = 2;
  rv.master_port = port;
  rv.timeout_seconds = timeout;
  rv.job_key = key;
  return rv;
}

// Rank 0 and rank 1 of a job with kKey; `stranger(port)` runs first, against rank 0 alone; rank 1
// joins once it is done. Both real ranks must then complete an all_gather. Returns rank 0's
// stderr (where it reports what it dropped).
std::string job_with_stranger(const std::function<void(int)>& stranger) {
  const int port = comm::pick_free_port();
  std::array<std::string, 2> errors;
  std::array<int64_t, 2> gathered_sum{};
  testing::internal::CaptureStderr();
  // Rank r contributes 10 + r to an all_gather and keeps the sum it got.
  const auto rank = [&](int r) {
    try {
      auto g = make_tcp_group(rendezvous(r, port, kKey));
      int64_t mine = 10 + r, all[2] = {};
      g->all_gather(&mine, all, sizeof(mine));
      gathered_sum[r] = all[0] + all[1];
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::thread rank0(rank, 0);
  stranger(port);
  std::thread rank1(rank, 1);
  rank0.join();
  rank1.join();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(gathered_sum[0], 21);
  EXPECT_EQ(gathered_sum[1], 21);
  return log;
}

comm::Socket connect(int port) { return comm::connect_to("127.0.0.1", port, 10); }

std::vector<char> read_challenge(comm::Socket& s) {
  const comm::Frame f = s.recv_frame("rank 0", 10);
  EXPECT_EQ(f.payload.size(), 32u);
  return f.payload;
}

void send_hello(comm::Socket& s, const WireHello& hello) {
  s.send_frame(comm::FrameType::data, &hello, sizeof(hello), "rank 0", 10);
}

// A proof for a challenge: HMAC-SHA256(key, label | challenge | rank | world), as a rank makes it.
std::array<uint8_t, 32> proof(const std::string& key, const std::vector<char>& challenge, int32_t rank, int32_t world) {
  std::string text("moka-tcp-hello-1", sizeof("moka-tcp-hello-1"));
  text.append(challenge.data(), challenge.size());
  for (int32_t v : {rank, world})
    for (int b = 0; b < 4; ++b) text.push_back(static_cast<char>(uint32_t(v) >> (8 * b)));
  return comm::hmac_sha256(key, std::vector<uint8_t>(text.begin(), text.end()));
}

bool reported_drop(const std::string& log, const std::string& why) {
  return log.find("rank 0 dropped a connection from 127.0.0.1:") != std::string::npos &&
         log.find(why) != std::string::npos;
}

TEST(TcpStrangers, AConnectThatClosesIsDropped) {
  const std::string log = job_with_stranger([](int port) { connect(port).close(); });
  EXPECT_TRUE(reported_drop(log, "rank 0 dropped")) << log;
}

TEST(TcpStrangers, GarbageIsDropped) {
  const std::string log = job_with_stranger([](int port) {
    comm::Socket s = connect(port);
    const char request[] = "GET / HTTP/1.0\r\n\r\n";
    ASSERT_GT(::send(s.fd(), request, sizeof(request) - 1, MSG_NOSIGNAL), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  });
  EXPECT_TRUE(reported_drop(log, "rank 0 dropped")) << log;
}

TEST(TcpStrangers, ASilentConnectionIsDroppedAfterTheHandshakeBound) {
  const auto start = std::chrono::steady_clock::now();
  comm::Socket held;  // stays open, silent, until the job is done
  const std::string log = job_with_stranger([&](int port) {
    held = connect(port);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  EXPECT_TRUE(reported_drop(log, "it sent no hello within 5 s")) << log;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
}

TEST(TcpStrangers, AForgedHelloIsDropped) {
  const std::string log = job_with_stranger([](int port) {
    comm::Socket s = connect(port);
    read_challenge(s);
    send_hello(s, WireHello{1, 2, {}});  // a rank's hello, no proof
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  EXPECT_TRUE(reported_drop(log, "its proof of the job key is wrong")) << log;
}

TEST(TcpStrangers, AReplayedHelloIsDropped) {
  // A hello captured from another connection proves the key for that connection's challenge only.
  const std::string log = job_with_stranger([](int port) {
    comm::Socket s = connect(port);
    const std::vector<char> challenge = read_challenge(s);
    std::vector<char> other = challenge;
    other[0] ^= 1;
    send_hello(s, WireHello{1, 2, proof(kKey, other, 1, 2)});
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  EXPECT_TRUE(reported_drop(log, "its proof of the job key is wrong")) << log;
}

TEST(TcpStrangers, TheRightProofIsAdmittedByTheSameCheck) {
  // The stranger's code path with the real key: what the drops above rely on is the key alone.
  const int port = comm::pick_free_port();
  std::string error;
  std::thread rank0([&] {
    try {
      auto g = make_tcp_group(rendezvous(0, port, kKey));
      char token = 0, all[2] = {};
      g->all_gather(&token, all, 1);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  comm::Socket s = connect(port);
  const std::vector<char> challenge = read_challenge(s);
  send_hello(s, WireHello{1, 2, proof(kKey, challenge, 1, 2)});
  const char token = 1;
  s.send_frame(comm::FrameType::data, &token, 1, "rank 0", 10);
  const comm::Frame all = s.recv_frame("rank 0", 10);
  rank0.join();
  EXPECT_EQ(error, "");
  EXPECT_EQ(all.payload.size(), 2u);
}

TEST(TcpStrangers, ARankWithAnotherKeyIsRefusedAndTold) {
  const int port = comm::pick_free_port();
  std::string error0, error1;
  testing::internal::CaptureStderr();
  std::thread rank0([&] {
    try {
      make_tcp_group(rendezvous(0, port, kKey, 2));
    } catch (const std::exception& e) {
      error0 = e.what();
    }
  });
  std::thread rank1([&] {
    try {
      auto g = make_tcp_group(rendezvous(1, port, "another key, 32 bytes long......", 2));
      g->barrier();
    } catch (const std::exception& e) {
      error1 = e.what();
    }
  });
  rank0.join();
  rank1.join();
  testing::internal::GetCapturedStderr();
  EXPECT_NE(error0.find("rank 1 did not connect"), std::string::npos) << error0;
  EXPECT_NE(error1.find("rank 0 refused this connection: its proof of the job key is wrong"), std::string::npos)
      << error1;
}

TEST(TcpStrangers, NoKeyOffLoopbackIsRefusedUnlessAllowed) {
  Rendezvous rv = rendezvous(1, 29500, "");
  rv.master_addr = "10.255.0.1";
  try {
    make_tcp_group(rv);
    ADD_FAILURE() << "a keyless rendezvous off loopback was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no job key for a rendezvous at 10.255.0.1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MOKA_ALLOW_UNAUTHENTICATED=1"), std::string::npos) << e.what();
  }
  rv.job_key = "short";
  try {
    make_tcp_group(rv);
    ADD_FAILURE() << "a 5-byte key was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs at least 16"), std::string::npos) << e.what();
  }
}

TEST(TcpStrangers, APeersAbortTextIsEscapedAndAttributedToItsConnection) {
  // Rank 1 (proven) claims in its abort that rank 3 failed, with terminal escapes around it.
  const int port = comm::pick_free_port();
  std::string error0;
  std::thread rank0([&] {
    try {
      auto g = make_tcp_group(rendezvous(0, port, kKey));
      g->barrier();
    } catch (const std::exception& e) {
      error0 = e.what();
    }
  });
  comm::Socket s = connect(port);
  const std::vector<char> challenge = read_challenge(s);
  send_hello(s, WireHello{1, 2, proof(kKey, challenge, 1, 2)});
  const std::string text = "\x1b[2J\x1b[31mrank 3 failed: it was rank 3\n";
  s.send_frame(comm::FrameType::abort, text.data(), text.size(), "rank 0", 10);
  rank0.join();
  EXPECT_NE(error0.find("rank 1 reports: \\x1b[2J\\x1b[31mrank 3 failed: it was rank 3\\x0a"), std::string::npos)
      << error0;
  EXPECT_EQ(error0.find('\x1b'), std::string::npos) << "a terminal escape reached the message";
}

// A stranger racing for the port. While rank 0 waits for its ranks it holds the port: the
// stranger cannot bind it. Once every rank is in, rank 0 lets it go, but each rank's traffic stays
// on the connection it proved itself on: a stranger listening there now gets no connection.
TEST(TcpStrangers, ThePortIsHeldUntilEveryRankIsInAndTakingItAfterGetsNothing) {
  const int port = comm::pick_free_port();
  std::array<std::string, 2> errors;
  std::array<int64_t, 2> gathered_sum{};
  std::latch formed(3), stranger_listens(1);
  const auto rank = [&](int r) {
    bool in = false;
    try {
      auto g = make_tcp_group(rendezvous(r, port, kKey));
      in = true;
      formed.arrive_and_wait();
      stranger_listens.wait();
      int64_t mine = 10 + r, all[2] = {};
      g->all_gather(&mine, all, sizeof(mine));
      gathered_sum[r] = all[0] + all[1];
    } catch (const std::exception& e) {
      errors[r] = e.what();
      if (!in) formed.count_down();  // the test goes on to report it
    }
  };
  testing::internal::CaptureStderr();
  std::thread rank0(rank, 0);
  connect(port).close();  // returns once rank 0 listens (and is dropped as a stranger)
  try {
    comm::listen_on("127.0.0.1", port);
    ADD_FAILURE() << "a stranger took the port while rank 0 waited for rank 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Address already in use"), std::string::npos) << e.what();
  }
  std::thread rank1(rank, 1);
  formed.arrive_and_wait();
  comm::Socket taken = comm::listen_on("127.0.0.1", port);  // free once every rank is in
  stranger_listens.count_down();
  rank0.join();
  rank1.join();
  testing::internal::GetCapturedStderr();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(gathered_sum[0], 21);
  EXPECT_EQ(gathered_sum[1], 21);
  EXPECT_FALSE(taken.readable_within(0.2)) << "a rank connected to the stranger that took the port";
}

// A stranger that holds the port before rank 0 binds it: rank 0 fails naming the port, and rank
// 1, which reaches the stranger, waits for a challenge that never comes, tells the stranger
// nothing and fails within its timeout.
TEST(TcpStrangers, APortTakenBeforeRank0FailsTheJobWithinItsBound) {
  const int port = comm::pick_free_port();
  comm::Socket stranger = comm::listen_on("127.0.0.1", port);
  std::array<std::string, 2> errors;
  const auto start = std::chrono::steady_clock::now();
  const auto rank = [&](int r) {
    try {
      make_tcp_group(rendezvous(r, port, kKey, 2));
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  testing::internal::CaptureStderr();
  std::thread rank0(rank, 0), rank1(rank, 1);
  rank0.join();
  rank1.join();
  testing::internal::GetCapturedStderr();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(errors[0].find("cannot listen on 127.0.0.1:" + std::to_string(port) + ": Address already in use"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1], "") << "rank 1 joined a job whose rank 0 was a stranger";
  ASSERT_TRUE(stranger.readable_within(1)) << "rank 1 never reached the stranger";
  comm::Socket from_rank1 = comm::accept_one(stranger);
  char byte = 0;
  EXPECT_EQ(::recv(from_rank1.fd(), &byte, 1, MSG_DONTWAIT), 0) << "rank 1 sent the stranger bytes";
}

}  // namespace
