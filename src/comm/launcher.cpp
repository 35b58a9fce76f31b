// `moka launch`: one worker process per GPU (or per emulated CPU rank), with the environment
// torchrun sets. When a worker fails the others get `grace_seconds` to notice (their group
// reports peer_failure) and are then killed, so the launcher never hangs.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string.h>
#include <string>
#include <thread>
#include <vector>

#include "comm/socket.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"

namespace moka {
namespace {

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

pid_t spawn(const std::vector<std::string>& args, int rank, int world, int port) {
  const pid_t pid = ::fork();
  require(pid >= 0, ErrorCode::io, std::string("fork: ") + std::strerror(errno));
  if (pid > 0) return pid;
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off unless the user decides
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "moka launch: cannot run %s: %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + ::strsignal(WTERMSIG(status));
  return "exited with code " + std::to_string(exit_code_of(status));
}

}  // namespace

int launch_workers(const std::vector<std::string>& args, const LaunchOptions& o) {
  require(!args.empty(), ErrorCode::invalid_argument, "moka launch needs a command after --");
  require(o.num_workers >= 1, ErrorCode::invalid_argument, "moka launch -n must be >= 1");
  const int port = comm::pick_free_port();
  ::signal(SIGINT, on_signal);
  ::signal(SIGTERM, on_signal);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.num_workers; ++r) pids.push_back(spawn(args, r, o.num_workers, port));

  using Clock = std::chrono::steady_clock;
  std::vector<int> status(o.num_workers, 0);
  int running = o.num_workers;
  bool failed = false, killed = false;
  Clock::time_point kill_at = Clock::time_point::max();
  while (running > 0) {
    int st = 0;
    const pid_t pid = ::waitpid(-1, &st, WNOHANG);
    if (pid > 0) {
      --running;
      int rank = 0;
      while (pids[rank] != pid) ++rank;
      status[rank] = st;
      if (exit_code_of(st) != 0 && !killed) {
        std::fprintf(stderr, "moka launch: worker %d %s\n", rank, describe(st).c_str());
        if (!failed) kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(o.grace_seconds));
        failed = true;
      }
      continue;
    }
    if (g_interrupted && !failed) {
      failed = true;
      kill_at = Clock::now();
    }
    if (!killed && Clock::now() >= kill_at) {
      for (pid_t p : pids) ::kill(p, SIGKILL);  // reaped workers ignore it
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The root cause wins the exit code: a worker that died by a signal, else the first failure.
  int code = g_interrupted ? 130 : 0;
  for (int st : status)
    if (WIFSIGNALED(st) && WTERMSIG(st) != SIGKILL && code == 0) code = exit_code_of(st);
  for (int st : status)
    if (exit_code_of(st) != 0 && code == 0) code = exit_code_of(st);
  return code;
}

}  // namespace moka
