// The TCP group against a peer that breaks the wire format: a raw socket plays rank 1 to a real
// rank 0 (or rank 0 to a real rank 1) and sends corrupted, truncated or oversized frames. Each
// must end in one moka::Error naming the sender, never a read past a buffer or a huge allocation.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include "comm/socket.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"

using namespace moka;
using comm::FrameType;

namespace {

constexpr double kTimeout = 5.0;

// Built with memcpy into sized vectors: GCC 12 warns falsely on vector::insert of raw bytes.
std::vector<char> bytes_of(const void* data, size_t bytes) {
  std::vector<char> out(bytes);
  if (bytes > 0) std::memcpy(out.data(), data, bytes);
  return out;
}

std::vector<char> concat(const std::vector<char>& a, const std::vector<char>& b) {
  std::vector<char> out(a.size() + b.size());
  std::copy(a.begin(), a.end(), out.begin());
  std::copy(b.begin(), b.end(), out.begin() + static_cast<std::ptrdiff_t>(a.size()));
  return out;
}

// A frame carrying `payload` whose header claims `announced` bytes (by default the truth).
std::vector<char> frame(const std::vector<char>& payload, FrameType type = FrameType::data,
                        uint32_t magic = comm::kFrameMagic, std::optional<uint64_t> announced = std::nullopt) {
  const comm::FrameHeader h{magic, static_cast<uint32_t>(type), announced.value_or(payload.size())};
  return concat(bytes_of(&h, sizeof(h)), payload);
}

// A header alone, announcing `bytes`.
std::vector<char> header(uint64_t bytes) { return frame({}, FrameType::data, comm::kFrameMagic, bytes); }

// An all-to-all message: a segment table followed by `extra` payload bytes.
std::vector<char> all_to_all_frame(const std::vector<uint64_t>& table, size_t extra) {
  return frame(concat(bytes_of(table.data(), table.size() * sizeof(uint64_t)), std::vector<char>(extra, 'x')));
}

// A data frame of `bytes` filler bytes: the right frame, the wrong size.
std::vector<char> filler_frame(size_t bytes) { return frame(std::vector<char>(bytes, 'x')); }

// An all_gather of `bytes` per rank in a 2-rank group.
std::function<void(ProcessGroup&)> gather(size_t bytes) {
  return [bytes](ProcessGroup& g) {
    std::vector<char> send(bytes), recv(2 * bytes);
    g.all_gather(send.data(), recv.data(), bytes);
  };
}

void send_raw(comm::Socket& s, const std::vector<char>& bytes) {
  ASSERT_EQ(::send(s.fd(), bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

// The hello of the wire format: rank, world size and a proof of the job key (zeros: these groups
// have no key, on loopback).
struct Hello {
  int32_t rank, world_size;
  uint8_t proof[32];
};

std::vector<char> hello_frame(int32_t rank, int32_t world) {
  const Hello h{rank, world, {}};
  return frame(bytes_of(&h, sizeof(h)));
}

struct Outcome {
  std::string message;
  ErrorCode code = ErrorCode::internal;
};

Outcome run_catching(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return {e.what(), e.code()};
  }
  return {"no error", ErrorCode::internal};
}

void empty_all_to_all(ProcessGroup& g) {
  std::vector<size_t> zeros(g.size(), 0);
  char buf = 0;
  g.all_to_all_v(&buf, zeros.data(), zeros.data(), &buf, zeros.data(), zeros.data());
}

Rendezvous two_ranks(int rank, int port) {
  Rendezvous rv;
  rv.rank = rank;
  rv.world_size = 2;
  rv.master_port = port;
  rv.timeout_seconds = kTimeout;
  return rv;
}

// A real rank 0 of a 2-rank group runs `collective`; a raw socket joins as rank 1, sends `wire`
// and (unless close_after) keeps the connection open until rank 0 is done. Returns rank 0's error.
Outcome rank_0_facing(const std::vector<char>& wire, const std::function<void(ProcessGroup&)>& collective,
                      bool close_after = false) {
  const int port = comm::pick_free_port();
  Outcome outcome;
  std::thread rank_0([&] { outcome = run_catching([&] { collective(*make_tcp_group(two_ranks(0, port))); }); });
  comm::Socket fake = comm::connect_to("127.0.0.1", port, kTimeout);
  fake.recv_frame("rank 0", kTimeout);  // the challenge
  send_raw(fake, wire);
  if (close_after) fake.close();
  rank_0.join();
  return outcome;
}

std::vector<char> after_hello(const std::vector<char>& wire) { return concat(hello_frame(1, 2), wire); }

void expect_error(const Outcome& o, ErrorCode code, const std::string& text) {
  EXPECT_EQ(o.code, code) << o.message;
  EXPECT_NE(o.message.find(text), std::string::npos) << o.message;
}

TEST(TcpWire, SegmentLargerThanThePayloadIsRefused) {
  // The reproduction: 1 MB claimed for rank 0, 16 bytes sent.
  expect_error(rank_0_facing(after_hello(all_to_all_frame({1 << 20, 0}, 16)), empty_all_to_all), ErrorCode::io,
               "rank 1 lists a segment of 1048576 bytes for rank 0 but only 16 bytes follow");
}

TEST(TcpWire, SegmentSizesThatOverflowWhenAddedAreRefused) {
  expect_error(rank_0_facing(after_hello(all_to_all_frame({UINT64_MAX, 2}, 1)), empty_all_to_all), ErrorCode::io,
               "rank 1 lists a segment of 18446744073709551615 bytes");
}

TEST(TcpWire, BytesBeyondTheSegmentTableAreRefused) {
  expect_error(rank_0_facing(after_hello(all_to_all_frame({0, 0}, 5)), empty_all_to_all), ErrorCode::io,
               "rank 1 sent 5 bytes more than its segment table lists");
}

TEST(TcpWire, MessageShorterThanItsSegmentTableIsRefused) {
  expect_error(rank_0_facing(after_hello(filler_frame(3)), empty_all_to_all), ErrorCode::io,
               "rank 1 sent 3 bytes, fewer than its table of 2 segment sizes");
}

TEST(TcpWire, OversizedFrameIsRefusedBeforeAllocating) {
  expect_error(rank_0_facing(after_hello(header(uint64_t{1} << 40)), empty_all_to_all), ErrorCode::io,
               "rank 1 announced a frame of 1099511627776 bytes, over the limit");
}

TEST(TcpWire, BadMagicIsRefused) {
  expect_error(rank_0_facing(after_hello(frame({}, FrameType::data, 0x12345678)), empty_all_to_all), ErrorCode::io,
               "rank 1 sent data that is not a moka frame");
}

TEST(TcpWire, UnknownFrameTypeIsRefused) {
  expect_error(rank_0_facing(after_hello(frame({}, static_cast<FrameType>(7))), empty_all_to_all), ErrorCode::io,
               "rank 1 sent a frame of unknown type 7");
}

TEST(TcpWire, FramesOnlyRank0SendsAreRefusedFromOthers) {
  expect_error(rank_0_facing(after_hello(frame({}, FrameType::stalled)), empty_all_to_all), ErrorCode::io,
               "rank 1 sent a frame only rank 0 sends");
}

TEST(TcpWire, TruncatedFrameIsAPeerFailure) {
  const auto wire = frame(std::vector<char>(10, 'x'), FrameType::data, comm::kFrameMagic, 100);
  expect_error(rank_0_facing(after_hello(wire), empty_all_to_all, /*close_after=*/true), ErrorCode::peer_failure,
               "rank 1 closed the connection");
}

TEST(TcpWire, TruncatedHeaderIsAPeerFailure) {
  auto wire = header(8);
  wire.resize(5);
  expect_error(rank_0_facing(after_hello(wire), empty_all_to_all, /*close_after=*/true), ErrorCode::peer_failure,
               "rank 1 closed the connection");
}

TEST(TcpWire, WrongAllGatherSizeNamesTheRank) {
  expect_error(rank_0_facing(after_hello(filler_frame(3)), gather(8)), ErrorCode::shape_mismatch,
               "rank 1 sent 3 bytes, rank 0 expected 8");
}

TEST(TcpWire, MalformedHellosAreDroppedAndAWrongWorldSizeStopsTheJob) {
  // A hello rank 0 cannot use is a stranger's: dropped (reported), and rank 0 goes on waiting for
  // rank 1 until the timeout. A well-formed hello with another world size is a misconfiguration.
  const auto connect_only = [](ProcessGroup&) {};
  testing::internal::CaptureStderr();
  expect_error(rank_0_facing(filler_frame(3), connect_only), ErrorCode::timeout, "rank 1 did not connect");
  expect_error(rank_0_facing(hello_frame(5, 2), connect_only), ErrorCode::timeout, "rank 1 did not connect");
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("it sent no moka hello (3 bytes)"), std::string::npos) << log;
  EXPECT_NE(log.find("it claims rank 5, which is out of range or already in"), std::string::npos) << log;
  expect_error(rank_0_facing(hello_frame(1, 1 << 30), connect_only), ErrorCode::shape_mismatch,
               "rank 1 has WORLD_SIZE 1073741824, rank 0 has 2");
}

// A real rank 1 of a 2-rank group runs `collective`; a raw socket plays rank 0: it accepts
// rank 1's hello, reads one frame and answers `reply`. Returns rank 1's error.
Outcome rank_1_facing(const std::vector<char>& reply, const std::function<void(ProcessGroup&)>& collective) {
  const int port = comm::pick_free_port();
  comm::Socket listener = comm::listen_on("127.0.0.1", port);
  Outcome outcome;
  std::thread rank_1([&] { outcome = run_catching([&] { collective(*make_tcp_group(two_ranks(1, port))); }); });
  EXPECT_TRUE(listener.readable_within(kTimeout));
  comm::Socket fake = comm::accept_one(listener);
  const std::vector<char> challenge(32, 'c');
  fake.send_frame(FrameType::data, challenge.data(), challenge.size(), "rank 1", kTimeout);
  fake.recv_frame("rank 1", kTimeout);  // hello
  fake.recv_frame("rank 1", kTimeout);  // its part of the collective
  send_raw(fake, reply);
  rank_1.join();
  return outcome;
}

TEST(TcpWire, Rank0RelayingAnInconsistentTableIsNamed) {
  expect_error(rank_1_facing(all_to_all_frame({0, 1 << 20}, 8), empty_all_to_all), ErrorCode::io,
               "rank 0 lists a segment of 1048576 bytes for rank 1 but only 8 bytes follow");
}

TEST(TcpWire, Rank0RelayingAWrongAllGatherSizeIsNamed) {
  expect_error(rank_1_facing(filler_frame(5), gather(4)), ErrorCode::shape_mismatch,
               "rank 0 relayed 5 bytes, rank 1 expected 2 x 4");
}

TEST(TcpWire, MalformedWaitingNoticeIsRefused) {
  const int32_t not_a_rank = 7;
  expect_error(rank_1_facing(frame(bytes_of(&not_a_rank, sizeof(not_a_rank)), FrameType::waiting), empty_all_to_all),
               ErrorCode::io, "rank 0 sent a malformed waiting notice");
}

TEST(TcpWire, SendingMoreThanTheFrameLimitIsRefusedUpFront) {
  // A size the receiver would refuse is refused by the sender, with the destination named.
  comm::Socket unconnected;
  try {
    unconnected.send_frame(FrameType::data, nullptr, comm::kMaxFrameBytes + 1, "rank 3", kTimeout);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("to rank 3 is over the TCP group's limit of 1024 MiB"), std::string::npos)
        << e.what();
  }
}

}  // namespace
