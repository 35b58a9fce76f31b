// `moka incast --gpus N`: does many-to-one traffic on NVSwitch slow an unrelated flow? k senders
// (k = 0..N-1) copy into GPU 0 while one of them also copies to GPU N-1 (the victim flow);
// prints the receiver's and the victim's throughput for each k, to tell whether expert-parallel
// skew (many ranks sending to one) costs the other ranks' traffic too.
#include <cstdio>
#include <iostream>

#include "bench_cuda.hpp"
#include "commands.hpp"
#include "moka/distributed.hpp"
#include "moka/moka.hpp"

namespace moka::cli {
namespace {

struct IncastOptions {
  int gpus = 4;
  int64_t megabytes = 512;
  int iters = 10;
  bool json = false;
};

void run(const IncastOptions& o) {
  require(cuda_backend_available(), ErrorCode::backend_unavailable, "moka incast needs GPUs (none is visible)");
  if (ran_as_workers(o.gpus, "incast")) return;
  auto workers = join_workers(true);
  require(workers != nullptr, ErrorCode::invalid_argument, "moka incast needs --gpus N (N >= 3) or moka launch");
  std::vector<IncastRow> rows;
  try {
    rows = run_incast(*workers, size_t(o.megabytes) << 20, o.iters);
  } catch (const std::exception& e) {
    workers->abort(e.what());
    throw;
  }
  if (rows.empty()) return;  // not rank 0
  if (!o.json) std::printf("%8s %14s %12s\n", "senders", "receiver GB/s", "victim GB/s");
  for (const auto& r : rows) {
    if (o.json) {
      std::printf("{\"gpus\": %d, \"megabytes\": %lld, \"iters\": %d, \"senders\": %d, \"receiver_gbs\": %.2f, "
                  "\"victim_gbs\": %.2f}\n",
                  workers->size(), static_cast<long long>(o.megabytes), o.iters, r.senders, r.receiver_gbs,
                  r.victim_gbs);
    } else {
      std::printf("%8d %14.1f %12.1f\n", r.senders, r.receiver_gbs, r.victim_gbs);
    }
  }
}

}  // namespace

void register_incast(CLI::App& app) {
  auto o = std::make_shared<IncastOptions>();
  auto* cmd = app.add_subcommand("incast", "Measure NVSwitch incast: k senders into one GPU and a victim flow");
  cmd->add_option("--gpus", o->gpus, "Worker processes, one per GPU")->check(CLI::Range(3, 64));
  cmd->add_option("--megabytes", o->megabytes, "Bytes per flow, in MiB")->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--iters", o->iters, "Timed rounds per sender count (median reported)")
      ->check(CLI::Range(1, 1000000));
  cmd->add_flag("--json", o->json, "One JSON line per sender count");
  cmd->callback([o] { run(*o); });
}

}  // namespace moka::cli
