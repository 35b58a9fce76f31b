// The TCP process group (ranks as threads here, processes in real jobs) and env rendezvous.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/socket.hpp"
#include "layer_fixture.hpp"
#include "moka/distributed.hpp"

using namespace moka;

namespace {

// Runs body(group) on `n` threads, each with its own TCP connection to rank 0.
void run_tcp_ranks(int n, const std::function<void(ProcessGroup&)>& body) {
  const int port = comm::pick_free_port();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        Rendezvous rv;
        rv.rank = r;
        rv.world_size = n;
        rv.master_port = port;
        rv.timeout_seconds = 10;
        auto g = make_tcp_group(rv);
        body(*g);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(TcpGroup, AllGatherAndAllToAllV) {
  const int n = 3;
  run_tcp_ranks(n, [&](ProcessGroup& g) {
    const int r = g.rank();
    int64_t mine = 100 + r;
    std::vector<int64_t> all(n);
    g.all_gather(&mine, all.data(), sizeof(mine));
    EXPECT_EQ(all, (std::vector<int64_t>{100, 101, 102}));
    // Rank r sends (r + p) values "r*10 + p" to p.
    std::vector<size_t> sb(n), so(n), rb(n), ro(n);
    std::vector<int32_t> send;
    for (int p = 0; p < n; ++p) {
      so[p] = send.size() * 4;
      for (int i = 0; i < r + p; ++i) send.push_back(r * 10 + p);
      sb[p] = (r + p) * 4;
    }
    size_t total = 0;
    for (int s = 0; s < n; ++s) {
      rb[s] = (s + r) * 4;
      ro[s] = total;
      total += rb[s];
    }
    std::vector<int32_t> recv(total / 4, -1);
    g.all_to_all_v(send.data(), sb.data(), so.data(), recv.data(), rb.data(), ro.data());
    size_t i = 0;
    for (int s = 0; s < n; ++s)
      for (int c = 0; c < s + r; ++c) EXPECT_EQ(recv[i++], s * 10 + r);
    g.barrier();
  });
}

TEST(TcpGroup, LayerOverTcpEqualsEmulatedRanks) {
  const MoeShape s{12, 10, 8, 2, 6, Activation::swiglu, 7.0f};
  const int n = 2;
  std::vector<test::Buffers<double>> a, b;
  for (int r = 0; r < n; ++r) a.push_back(test::random_buffers<double>(s, n, 17, 3, core::RoutingKind::zipf, r));
  b = a;
  run_emulated_ranks(n, [&](ProcessGroup& g) {
    test::run_layer(*make_moe_layer(s, Backend::cpu, &g, LayerOptions{4, 1}), a[g.rank()]);
  });
  run_tcp_ranks(n, [&](ProcessGroup& g) {
    test::run_layer(*make_moe_layer(s, Backend::cpu, &g, LayerOptions{4, 1}), b[g.rank()]);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(std::memcmp(a[r].out.data(), b[r].out.data(), a[r].out.size() * 8), 0);
    EXPECT_EQ(std::memcmp(a[r].d_x.data(), b[r].d_x.data(), a[r].d_x.size() * 8), 0);
    EXPECT_EQ(std::memcmp(a[r].d_w_up.data(), b[r].d_w_up.data(), a[r].d_w_up.size() * 8), 0);
  }
}

TEST(TcpGroup, AbortReachesEveryPeerWithTheReason) {
  const int port = comm::pick_free_port();
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      Rendezvous rv;
      rv.rank = r;
      rv.world_size = 3;
      rv.master_port = port;
      rv.timeout_seconds = 10;
      auto g = make_tcp_group(rv);
      try {
        if (r == 2) throw Error(ErrorCode::invalid_argument, "bad input on purpose");
        g->barrier();
      } catch (const Error& e) {
        errors[r] = e.what();
        g->abort(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[0].find("rank 2 failed"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 2 failed"), std::string::npos) << errors[1];
}

TEST(TcpGroup, APeerThatStopsAnsweringTimesOut) {
  const int port = comm::pick_free_port();
  std::string error;
  std::thread silent([&] {
    Rendezvous rv;
    rv.rank = 1;
    rv.world_size = 2;
    rv.master_port = port;
    auto g = make_tcp_group(rv);
    std::this_thread::sleep_for(std::chrono::milliseconds(800));  // never joins the barrier
  });
  try {
    Rendezvous rv;
    rv.world_size = 2;
    rv.master_port = port;
    rv.timeout_seconds = 0.3;
    make_tcp_group(rv)->barrier();
  } catch (const Error& e) {
    error = e.what();
  }
  silent.join();
  EXPECT_NE(error.find("rank 1 did not answer"), std::string::npos) << error;
}

TEST(Rendezvous, ReadsTorchrunAndSlurmVariables) {
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "8", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("MASTER_ADDR", "10.1.2.3", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  auto rv = rendezvous_from_env();
  EXPECT_EQ(rv.rank, 3);
  EXPECT_EQ(rv.world_size, 8);
  EXPECT_EQ(rv.local_rank, 1);
  EXPECT_EQ(rv.master_addr, "10.1.2.3");
  EXPECT_EQ(rv.master_port, 1234);
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
  ::setenv("SLURM_PROCID", "5", 1);
  ::setenv("SLURM_NTASKS", "6", 1);
  rv = rendezvous_from_env();
  EXPECT_EQ(rv.rank, 5);
  EXPECT_EQ(rv.world_size, 6);
  ::setenv("SLURM_PROCID", "9", 1);
  EXPECT_THROW(rendezvous_from_env(), Error);
  ::unsetenv("SLURM_PROCID");
  ::unsetenv("SLURM_NTASKS");
  EXPECT_FALSE(launched_as_worker());
}

}  // namespace
