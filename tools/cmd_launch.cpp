// `moka launch -n N -- ARGS`: runs N worker processes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT set). ARGS starting with a moka subcommand run this moka; anything else runs as a
// program. Exits with the chronologically first failing worker's code after stopping all of them.
#include <unistd.h>

#include <cstdlib>

#include "bench_cuda.hpp"
#include "commands.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"
#include "option_checks.hpp"

namespace moka::cli {
namespace {
std::vector<std::string> g_command_line;
}

const std::vector<std::string>& command_line() { return g_command_line; }

void set_command_line(int argc, char** argv) { g_command_line.assign(argv, argv + argc); }

std::string self_executable() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  require(n > 0, ErrorCode::io, "cannot find the moka executable (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

bool ran_as_workers(int gpus, const std::string& what) {
  if (gpus <= 1 || launched_as_worker()) return false;
  std::vector<std::string> args(command_line());
  args[0] = self_executable();
  const int rc = launch_workers(args, LaunchOptions{gpus, 10.0});
  require(rc == 0, ErrorCode::peer_failure, "a " + what + " worker failed (exit code " + std::to_string(rc) + ")");
  return true;
}

std::unique_ptr<ProcessGroup> join_workers(bool on_gpu) {
  if (!launched_as_worker()) return nullptr;
  const Rendezvous rv = rendezvous_from_env();
  if (on_gpu) select_worker_device(rv.local_rank);
  return make_tcp_group(rv);
}

void register_launch(CLI::App& app) {
  struct Options {
    int workers = 1;
    double grace = 10.0;
    std::vector<std::string> args;
  };
  auto o = std::make_shared<Options>();
  auto* cmd = app.add_subcommand("launch", "Run one worker process per GPU: moka launch -n N -- bench ...");
  cmd->add_option("-n,--workers", o->workers, "Number of worker processes")->required();
  cmd->add_option("--grace", o->grace, "Seconds the others get to exit after one worker fails")
      ->check(finite_range(0, LaunchOptions::kMaxGraceSeconds));
  cmd->add_option("args", o->args, "The command after --")->required();
  cmd->callback([o, &app] {
    std::vector<std::string> args = o->args;
    bool is_moka_command = false;
    for (const auto* sub : app.get_subcommands({})) is_moka_command |= sub->get_name() == args.front();
    if (is_moka_command) args.insert(args.begin(), self_executable());
    const int rc = launch_workers(args, LaunchOptions{o->workers, o->grace});
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace moka::cli
