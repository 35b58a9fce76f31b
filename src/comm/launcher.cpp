// `moka launch`: one worker process per GPU (or per emulated CPU rank), with the environment
// torchrun sets. When a worker fails the others get `grace_seconds` to notice (their group
// reports peer_failure) and are then killed, so the launcher never hangs. The launcher names the
// chronologically first failure: the others' failures are consequences of it. Every worker leads
// a process group of its own, so that stopping it stops what it started too; a SIGINT or SIGTERM
// of the launcher is passed on to the workers, which get the grace period to exit (a trainer
// saves its checkpoint) before they are killed.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string.h>
#include <string>
#include <vector>

#include "comm/auth.hpp"
#include "comm/socket.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"

namespace moka {
namespace {

volatile sig_atomic_t g_interrupted = 0;  // the SIGINT or SIGTERM that interrupted the launcher, else 0
void on_signal(int signal) { g_interrupted = signal; }

// A worker in a process group of its own (set on both sides of the fork, so that neither a
// signal nor a kill can reach it before the group exists); -1 when fork failed (errno says why).
pid_t spawn(const std::vector<std::string>& args, int rank, int world, int port, const std::string& job_key,
            const sigset_t& worker_mask) {
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) {
    if (pid > 0) ::setpgid(pid, pid);
    return pid;
  }
  ::setpgid(0, 0);
  // Outside the launcher's process group no terminal signal reaches the worker: it dies with the
  // launcher instead (a launcher killed by SIGKILL leaves no job running).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(137);
  ::sigprocmask(SIG_SETMASK, &worker_mask, nullptr);  // the launcher blocks SIGCHLD; workers must not
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off unless the user decides
  if (!job_key.empty()) ::setenv("MOKA_JOB_KEY", job_key.c_str(), 1);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "moka launch: cannot run %s: %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

// 128 + signal for a worker killed (or left stopped) by a signal, as shells report it.
int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  if (WIFSTOPPED(status)) return 128 + WSTOPSIG(status);
  return 1;
}

std::string describe(int status) {
  const auto signal_text = [](int s) { return std::to_string(s) + " (" + ::strsignal(s) + ")"; };
  if (WIFSIGNALED(status)) return "was killed by signal " + signal_text(WTERMSIG(status));
  if (WIFSTOPPED(status)) return "was stopped by signal " + signal_text(WSTOPSIG(status)) + " and never resumed";
  return "exited with code " + std::to_string(exit_code_of(status));
}

struct Worker {
  pid_t pid;
  bool running = true;
  bool killed = false;      // by the launcher, after the first failure
  int stop_status = 0;      // while stopped (SIGSTOP, SIGTSTP): its waitpid status
  uint64_t stopped_at = 0;  // order of the stop among all events, 0 while not stopped
};

struct StatusChange {
  int rank;
  int status;
};

// Status changes ready now, in the order the launcher should believe they happened. waitpid
// reports ready children in fork order, not in time order, so changes collected in one pass are
// ties: stops first, then deaths by a signal, then exits, since a worker that notices a peer's
// failure exits on its own.
std::vector<StatusChange> collect_status_changes(const std::vector<Worker>& workers) {
  std::vector<StatusChange> out;
  int st = 0;
  pid_t pid;
  while ((pid = ::waitpid(-1, &st, WNOHANG | WUNTRACED | WCONTINUED)) > 0) {
    for (int r = 0; r < static_cast<int>(workers.size()); ++r)
      if (workers[r].pid == pid) out.push_back({r, st});
  }
  const auto order = [](int status) { return WIFSTOPPED(status) ? 0 : WIFSIGNALED(status) ? 1 : 2; };
  std::stable_sort(out.begin(), out.end(),
                   [&](const StatusChange& a, const StatusChange& b) { return order(a.status) < order(b.status); });
  return out;
}

struct Failure {
  int rank;
  int status;
};

// The job's first failure, seen when `change` ends a worker badly: a worker stopped since
// before it cannot answer its peers and caused it, else `change` itself.
Failure first_failure(const std::vector<Worker>& workers, const StatusChange& change) {
  Failure f{change.rank, change.status};
  uint64_t earliest = UINT64_MAX;
  for (int r = 0; r < static_cast<int>(workers.size()); ++r) {
    if (workers[r].running && workers[r].stopped_at != 0 && workers[r].stopped_at < earliest) {
      earliest = workers[r].stopped_at;
      f = Failure{r, workers[r].stop_status};
    }
  }
  return f;
}

// Sends `signal` to the process group a worker leads (the worker and whatever it started).
void signal_worker(const Worker& w, int signal) { ::kill(-w.pid, signal); }

// Starts `count` workers, each a process group; when a fork fails the ones started are killed
// and reaped before the error is raised, so none runs on unsupervised. They prove themselves to
// each other with a fresh random job key, unless the caller gave one (MOKA_JOB_KEY or
// MOKA_JOB_KEY_FILE, which the workers then read themselves).
std::vector<Worker> spawn_workers(const std::vector<std::string>& args, int count, int port, const sigset_t& mask) {
  const bool caller_key = std::getenv("MOKA_JOB_KEY") || std::getenv("MOKA_JOB_KEY_FILE");
  const std::string job_key = caller_key ? std::string() : comm::random_key();
  std::vector<Worker> workers;
  for (int r = 0; r < count; ++r) {
    const pid_t pid = spawn(args, r, count, port, job_key, mask);
    if (pid > 0) {
      workers.push_back(Worker{pid});
      continue;
    }
    const int error = errno;
    for (const Worker& w : workers) signal_worker(w, SIGKILL);
    for (const Worker& w : workers) ::waitpid(w.pid, nullptr, 0);
    throw Error(ErrorCode::io, "moka launch: cannot start worker " + std::to_string(r) + " of " +
                                   std::to_string(count) + " (fork: " + std::strerror(error) + "); stopped the " +
                                   std::to_string(r) + " started");
  }
  return workers;
}

// The most workers this machine lets us start: kMaxWorkers, or fewer under RLIMIT_NPROC.
int worker_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NPROC, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return LaunchOptions::kMaxWorkers;
  return static_cast<int>(std::min<rlim_t>(limit.rlim_cur, LaunchOptions::kMaxWorkers));
}

}  // namespace

int launch_workers(const std::vector<std::string>& args, const LaunchOptions& o) {
  require(!args.empty(), ErrorCode::invalid_argument, "moka launch needs a command after --");
  require(o.num_workers >= 1, ErrorCode::invalid_argument, "moka launch -n must be >= 1");
  const int limit = worker_limit();
  require(o.num_workers <= limit, ErrorCode::invalid_argument,
          "moka launch -n " + std::to_string(o.num_workers) + " exceeds the " + std::to_string(limit) +
              " workers this machine allows (at most " + std::to_string(LaunchOptions::kMaxWorkers) +
              " ranks, and the process limit, ulimit -u)");
  require(o.grace_seconds >= 0 && o.grace_seconds <= LaunchOptions::kMaxGraceSeconds, ErrorCode::invalid_argument,
          "moka launch --grace must be a finite number of seconds in [0, " +
              std::to_string(static_cast<int64_t>(LaunchOptions::kMaxGraceSeconds)) + "]");
  const int port = comm::pick_free_port();
  ::signal(SIGINT, on_signal);
  ::signal(SIGTERM, on_signal);
  // SIGCHLD stays blocked so that sigtimedwait wakes the launcher as soon as a worker changes
  // state: the first failure must be seen before the failures it causes.
  sigset_t child_changed, caller_mask;
  ::sigemptyset(&child_changed);
  ::sigaddset(&child_changed, SIGCHLD);
  ::pthread_sigmask(SIG_BLOCK, &child_changed, &caller_mask);
  std::vector<Worker> workers;
  try {
    workers = spawn_workers(args, o.num_workers, port, caller_mask);
  } catch (...) {
    ::pthread_sigmask(SIG_SETMASK, &caller_mask, nullptr);
    throw;
  }
  const auto grace =
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(o.grace_seconds));
  bool passed_on = false;  // the launcher's SIGINT or SIGTERM, to every worker

  using Clock = std::chrono::steady_clock;
  std::optional<Failure> failure;
  Clock::time_point kill_at = Clock::time_point::max();
  int running = o.num_workers;
  uint64_t changes = 0;
  while (running > 0) {
    for (const StatusChange& c : collect_status_changes(workers)) {
      Worker& w = workers[c.rank];
      ++changes;
      if (WIFCONTINUED(c.status)) {
        w.stopped_at = 0;
      } else if (WIFSTOPPED(c.status)) {
        w.stop_status = c.status;
        w.stopped_at = changes;
      } else {
        w.running = false;
        --running;
        if (!failure && !g_interrupted && exit_code_of(c.status) != 0) {
          failure = first_failure(workers, c);
          kill_at = Clock::now() + grace;
        }
      }
    }
    if (g_interrupted && !passed_on) {
      for (const Worker& w : workers)
        if (w.running) signal_worker(w, g_interrupted);
      passed_on = true;
      kill_at = std::min(kill_at, Clock::now() + grace);
    }
    // A stopped worker cannot notice the failure, so it does not get the grace period.
    for (Worker& w : workers) {
      if (w.running && !w.killed && (Clock::now() >= kill_at || (failure && w.stopped_at != 0))) {
        signal_worker(w, SIGKILL);
        w.killed = true;
      }
    }
    if (running == 0) break;
    // At most until the grace period ends, and never longer than 100 ms in case another thread
    // of this process took the SIGCHLD.
    const Clock::duration until_kill = kill_at - Clock::now();
    Clock::duration wait = std::chrono::milliseconds(100);
    if (until_kill > Clock::duration::zero()) wait = std::min(wait, until_kill);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait);
    const timespec ts{static_cast<time_t>(ns.count() / 1'000'000'000), static_cast<long>(ns.count() % 1'000'000'000)};
    ::sigtimedwait(&child_changed, nullptr, &ts);  // a worker changed state, a signal, or the time is up
  }
  ::pthread_sigmask(SIG_SETMASK, &caller_mask, nullptr);
  // What a failed or stopped job's workers started and left behind goes too.
  if (failure || g_interrupted)
    for (const Worker& w : workers) signal_worker(w, SIGKILL);

  if (g_interrupted) {
    std::fprintf(stderr, "moka launch: interrupted by %s; passed it on to the workers%s\n",
                 g_interrupted == SIGINT ? "SIGINT" : "SIGTERM",
                 std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.killed; })
                     ? " and killed those still running after the grace period"
                     : "");
    return 128 + g_interrupted;  // as a shell reports a process the signal ended
  }
  if (!failure) return 0;
  const bool killed_any = std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.killed; });
  const std::string others = o.num_workers == 1 ? ""
                             : killed_any       ? " (first failure); stopped the other workers"
                                                : " (first failure); the other workers exited";
  std::fprintf(stderr, "moka launch: rank %d %s%s\n", failure->rank, describe(failure->status).c_str(), others.c_str());
  return exit_code_of(failure->status);
}

}  // namespace moka
