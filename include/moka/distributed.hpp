// Multi-process jobs: rendezvous from the environment launchers set, a TCP process group for
// host-side collectives (CPU backend, and exchanging the NCCL unique id), and a launcher that
// runs one worker process per GPU and stops them all when one fails.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "moka/process_group.hpp"

namespace moka {

struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_seconds = 60.0;  // connect and every collective; MOKA_COMM_TIMEOUT_S overrides
  // The job's secret (MOKA_JOB_KEY, or the first line of the file MOKA_JOB_KEY_FILE; at least 16
  // bytes; `moka launch` makes a random one per job): every rank proves it holds it when it
  // joins, so a stranger that reaches the port can neither join nor stop the job. Empty: no
  // proof, which only a loopback master_addr allows, or allow_unauthenticated
  // (MOKA_ALLOW_UNAUTHENTICATED=1).
  std::string job_key;
  bool allow_unauthenticated = false;
};

// Reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT/MOKA_COMM_TIMEOUT_S (torchrun,
// `moka launch`), MOKA_JOB_KEY/MOKA_JOB_KEY_FILE/MOKA_ALLOW_UNAUTHENTICATED, falling back to Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and Open MPI's
// OMPI_COMM_WORLD_*. An empty variable counts as unset; world_size is 0 when no size is set.
// Every value must be whole and in range (ranks below the world size, a port in 1..65535, a
// positive finite timeout), else Error(invalid_argument) names the variable and its value.
Rendezvous rendezvous_from_env();
bool launched_as_worker();  // WORLD_SIZE (or an equivalent) is set and > 1

// Connects the ranks over TCP (rank 0 listens on master_addr:master_port). Collectives relay
// through rank 0. A peer that closes its connection raises peer_failure naming the rank; a rank
// that aborts tells the others why. A rank waiting longer than min(10 s, timeout / 4) prints
// progress to stderr; rank 0 tells the others whom it waits for, and when that rank stays silent
// for the timeout every rank raises timeout naming it. Malformed or oversized messages raise io
// naming the sender.
std::unique_ptr<ProcessGroup> make_tcp_group(const Rendezvous& rendezvous);

struct LaunchOptions {
  // The grace period becomes steady_clock nanoseconds added to now(): a million seconds (11.6
  // days) stays far inside their int64 range.
  static constexpr double kMaxGraceSeconds = 1e6;
  // At most this many workers (the ranks a group takes), and no more than the machine lets this
  // user start processes (the soft RLIMIT_NPROC).
  static constexpr int kMaxWorkers = 4096;
  int num_workers = 1;
  double grace_seconds = 10.0;  // after one worker fails, how long the others get to exit, [0, kMaxGraceSeconds]
};

// Runs `args` (argv[0] is the program) as num_workers processes with RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT set. Returns 0 when all succeed; otherwise, after every
// worker has stopped, prints one line naming the chronologically first failure's rank (a worker
// left stopped by SIGSTOP counts from when it stopped) and returns its exit code (128 + signal
// for a killed or stopped worker).
int launch_workers(const std::vector<std::string>& args, const LaunchOptions& options);

}  // namespace moka
