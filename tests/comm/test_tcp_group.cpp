// The TCP process group (ranks as threads here, processes in real jobs) and env rendezvous.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <latch>
#include <limits>
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
  EXPECT_NE(error.find("rank 1 sent nothing for MOKA_COMM_TIMEOUT_S=0.3 s"), std::string::npos) << error;
}

struct RankOutcome {
  std::string message;
  ErrorCode code = ErrorCode::internal;
};

// Runs n ranks of a group with `timeout`; rank r calls body(r, make_group). Returns each rank's error.
std::vector<RankOutcome> run_ranks_catching(
    int n, double timeout,
    const std::function<void(int, const std::function<std::unique_ptr<ProcessGroup>()>&)>& body) {
  const int port = comm::pick_free_port();
  std::vector<RankOutcome> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const auto make_group = [&] {
        Rendezvous rv;
        rv.rank = r;
        rv.world_size = n;
        rv.master_port = port;
        rv.timeout_seconds = timeout;
        return make_tcp_group(rv);
      };
      try {
        body(r, make_group);
      } catch (const Error& e) {
        out[r] = {e.what(), e.code()};
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(TcpGroup, EveryRankNamesTheRankThatStalled) {
  // Rank 1 joins the group but not the barrier until the others gave up. Rank 2 waits for rank 0
  // longer than the timeout (rank 0 comes late), yet must blame rank 1: rank 0 tells it whom it
  // waits for.
  testing::internal::CaptureStderr();
  std::latch others_done(2);
  const auto outcomes = run_ranks_catching(3, 1.0, [&](int r, const auto& make_group) {
    auto g = make_group();
    if (r == 1) {
      others_done.wait();
      return;
    }
    struct CountDownOnExit {
      std::latch& latch;
      ~CountDownOnExit() { latch.count_down(); }
    } count_down{others_done};
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    g->barrier();
  });
  const std::string progress = testing::internal::GetCapturedStderr();
  for (int r : {0, 2}) {
    EXPECT_EQ(outcomes[r].code, ErrorCode::timeout) << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find("rank 1 sent nothing for MOKA_COMM_TIMEOUT_S=1 s in a collective: it "
                                       "stalled or was stopped"),
              std::string::npos)
        << "rank " << r << ": " << outcomes[r].message;
  }
  EXPECT_NE(progress.find("moka: rank 0 waiting for rank 1 ("), std::string::npos) << progress;
  EXPECT_NE(progress.find("moka: rank 2 waiting for rank 1, relayed by rank 0 ("), std::string::npos) << progress;
}

TEST(TcpGroup, ARank0ThatStallsIsNamedByTheOthers) {
  const auto outcomes = run_ranks_catching(2, 0.3, [](int r, const auto& make_group) {
    auto g = make_group();
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      return;
    }
    g->barrier();
  });
  EXPECT_EQ(outcomes[1].code, ErrorCode::timeout);
  EXPECT_NE(outcomes[1].message.find("rank 0 sent nothing for MOKA_COMM_TIMEOUT_S=0.3 s: it stalled or was stopped"),
            std::string::npos)
      << outcomes[1].message;
}

TEST(TcpGroup, ARankThatNeverConnectsIsNamedToTheOthers) {
  const auto outcomes = run_ranks_catching(3, 0.4, [](int r, const auto& make_group) {
    if (r == 2) return;  // never connects
    make_group()->barrier();
  });
  for (int r : {0, 1}) {
    EXPECT_EQ(outcomes[r].code, ErrorCode::timeout) << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find("rank 2 did not connect to rank 0 at 127.0.0.1:"), std::string::npos)
        << "rank " << r << ": " << outcomes[r].message;
  }
}

// Sets environment variables for one test and clears every rendezvous variable around it.
class RendezvousEnv : public testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOKA_COMM_TIMEOUT_S",
                          "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK",
                          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"})
      ::unsetenv(v);
  }
  // The invalid_argument message rendezvous_from_env raises, or "" when it accepts.
  static std::string rejection() {
    try {
      rendezvous_from_env();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return e.what();
    }
    return "";
  }
};

TEST_F(RendezvousEnv, MalformedValuesAreNamedWithTheirVariable) {
  struct Case {
    std::vector<std::pair<const char*, const char*>> env;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{{"WORLD_SIZE", "two"}}, "WORLD_SIZE='two' is not an integer"},
      {{{"WORLD_SIZE", "4x"}}, "WORLD_SIZE='4x' is not an integer"},
      {{{"WORLD_SIZE", " 4"}}, "WORLD_SIZE=' 4' is not an integer"},
      {{{"WORLD_SIZE", "0"}}, "WORLD_SIZE=0 is outside [1, 65536]"},
      {{{"WORLD_SIZE", "99999999999"}}, "WORLD_SIZE=99999999999 is outside [1, 65536]"},
      {{{"WORLD_SIZE", "4"}, {"RANK", "abc"}}, "RANK='abc' is not an integer"},
      {{{"WORLD_SIZE", "4"}, {"RANK", "4"}}, "RANK=4 is outside [0, 3] (WORLD_SIZE=4)"},
      {{{"WORLD_SIZE", "4"}, {"RANK", "-1"}}, "RANK=-1 is outside [0, 3] (WORLD_SIZE=4)"},
      {{{"WORLD_SIZE", "4"}, {"LOCAL_RANK", "7"}}, "LOCAL_RANK=7 is outside [0, 3] (WORLD_SIZE=4)"},
      {{{"MASTER_PORT", "99999"}}, "MASTER_PORT=99999 is outside [1, 65535]"},
      {{{"MASTER_PORT", "0"}}, "MASTER_PORT=0 is outside [1, 65535]"},
      {{{"MASTER_PORT", "http"}}, "MASTER_PORT='http' is not an integer"},
      {{{"MOKA_COMM_TIMEOUT_S", "abc"}}, "MOKA_COMM_TIMEOUT_S='abc' is not a positive number of seconds"},
      {{{"MOKA_COMM_TIMEOUT_S", "0"}}, "MOKA_COMM_TIMEOUT_S='0' is not a positive number of seconds"},
      {{{"MOKA_COMM_TIMEOUT_S", "-5"}}, "MOKA_COMM_TIMEOUT_S='-5' is not a positive number of seconds"},
      {{{"MOKA_COMM_TIMEOUT_S", "inf"}}, "MOKA_COMM_TIMEOUT_S='inf' is not a positive number of seconds"},
      {{{"MOKA_COMM_TIMEOUT_S", "nan"}}, "MOKA_COMM_TIMEOUT_S='nan' is not a positive number of seconds"},
      {{{"MOKA_COMM_TIMEOUT_S", "5s"}}, "MOKA_COMM_TIMEOUT_S='5s' is not a positive number of seconds"},
      {{{"SLURM_NTASKS", "2(x3)"}}, "SLURM_NTASKS='2(x3)' is not an integer"},
      {{{"SLURM_NTASKS", "2"}, {"SLURM_PROCID", "2"}}, "SLURM_PROCID=2 is outside [0, 1] (SLURM_NTASKS=2)"},
      {{{"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_RANK", "x"}}, "OMPI_COMM_WORLD_RANK='x' is not an integer"},
      {{{"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "9"}},
       "OMPI_COMM_WORLD_LOCAL_RANK=9 is outside [0, 2] (OMPI_COMM_WORLD_SIZE=3)"},
  };
  for (const Case& c : cases) {
    clear();
    for (const auto& [name, value] : c.env) ::setenv(name, value, 1);
    EXPECT_NE(rejection().find(c.expected), std::string::npos) << "expected: " << c.expected;
  }
}

TEST_F(RendezvousEnv, WellFormedValuesAndEmptyOnesAreAccepted) {
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "3", 1);
  ::setenv("MASTER_PORT", "65535", 1);
  ::setenv("MOKA_COMM_TIMEOUT_S", "2.5", 1);
  ::setenv("LOCAL_RANK", "", 1);  // empty means unset: the local rank defaults to the rank
  const Rendezvous rv = rendezvous_from_env();
  EXPECT_EQ(rv.world_size, 4);
  EXPECT_EQ(rv.rank, 3);
  EXPECT_EQ(rv.local_rank, 3);
  EXPECT_EQ(rv.master_port, 65535);
  EXPECT_EQ(rv.timeout_seconds, 2.5);
}

TEST(TcpGroup, OutOfRangeRendezvousIsRefused) {
  const auto refused = [](Rendezvous rv, const std::string& text) {
    try {
      make_tcp_group(rv);
      ADD_FAILURE() << "accepted; expected " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  Rendezvous rv;
  rv.world_size = 0;
  refused(rv, "world size 0 is outside");
  rv.world_size = 2;
  rv.rank = 2;
  refused(rv, "rank 2 is outside [0, 1]");
  rv.rank = 0;
  rv.master_port = 70000;
  refused(rv, "master port 70000 is outside [1, 65535]");
  rv.master_port = 1234;
  rv.timeout_seconds = std::numeric_limits<double>::infinity();
  refused(rv, "timeout must be a positive number of seconds");
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
