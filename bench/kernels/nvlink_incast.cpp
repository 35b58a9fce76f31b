// nvlink_incast, run as `moka launch -n N -- nvlink_incast` (N >= 3): does many-to-one traffic on
// NVSwitch slow an unrelated flow? k = 0..N-1 senders (ranks 1..k) each copy --megabytes into
// GPU 0 at once while rank 1 also copies as much to GPU N-1 (the victim flow), all through peer
// copies over NVLink; one JSON line per k with the receiver's and the victim's throughput
// (medians over --iters), to tell whether expert-parallel skew (many ranks sending to one) costs
// the other ranks' traffic too. Its copies are checked by size only: nothing is computed.
#include <cstdio>

#include "kernel_lab.hpp"
#include "moka/device_group.hpp"

namespace moka::lab {
namespace {

struct Options {
  int64_t megabytes = 512;
  int iters = 10;
};

// One timed copy on a stream: events around it, read after it finished.
class Flow {
 public:
  Flow() {
    MOKA_CUDA_CHECK(cudaEventCreate(&begin_));
    MOKA_CUDA_CHECK(cudaEventCreate(&end_));
  }
  ~Flow() {
    cudaEventDestroy(begin_);
    cudaEventDestroy(end_);
  }
  Flow(const Flow&) = delete;
  Flow& operator=(const Flow&) = delete;
  void start(cudaStream_t s) { MOKA_CUDA_CHECK(cudaEventRecord(begin_, s)); }
  void stop(cudaStream_t s) { MOKA_CUDA_CHECK(cudaEventRecord(end_, s)); }
  double ms() const {
    MOKA_CUDA_CHECK(cudaEventSynchronize(end_));
    float t = 0;
    MOKA_CUDA_CHECK(cudaEventElapsedTime(&t, begin_, end_));
    return t;
  }

 private:
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
};

struct IncastRow {
  int senders = 0;
  double receiver_gbs = 0;  // k * bytes / the slowest sender's copy time
  double victim_gbs = 0;    // bytes / the victim copy's time
};

// Collective over the workers; rank 0 returns the rows (k = 0: the victim flow alone).
std::vector<IncastRow> measure(ProcessGroup& workers, size_t bytes, int iters) {
  const int R = workers.size(), rank = workers.rank();
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  auto group = make_nccl_group(workers, device);
  const SymmetricBuffer& inbox = group->allocate_symmetric(bytes * R);  // slot s: from rank s
  const cli::DeviceBuffer src(bytes), victim_src(bytes);
  const cli::CaseStream incast_stream("nvlink_incast"), victim_stream("nvlink_incast");
  auto copy_to = [&](int peer, const cli::DeviceBuffer& from, cudaStream_t s) {
    char* slot = static_cast<char*>(inbox.peers[peer]) + size_t(rank) * bytes;
    MOKA_CUDA_CHECK(cudaMemcpyAsync(slot, from.data(), bytes, cudaMemcpyDeviceToDevice, s));
  };
  std::vector<IncastRow> rows;
  for (int k = 0; k < R; ++k) {
    const bool sends = rank >= 1 && rank <= k, victim = rank == 1;
    std::vector<double> incast_ms, victim_ms;
    for (int i = 0; i < iters + 1; ++i) {  // the first round warms up
      workers.barrier();                   // the flows start together (host barrier: tens of us against ms copies)
      // Both of rank 1's flows are in flight together, each timed on its own stream.
      Flow incast, victim_flow;
      if (sends) incast.start(incast_stream.s), copy_to(0, src, incast_stream.s), incast.stop(incast_stream.s);
      if (victim)
        victim_flow.start(victim_stream.s), copy_to(R - 1, victim_src, victim_stream.s),
            victim_flow.stop(victim_stream.s);
      if (i > 0) incast_ms.push_back(sends ? incast.ms() : 0), victim_ms.push_back(victim ? victim_flow.ms() : 0);
    }
    const double slowest_sender = cli::max_over_ranks(workers, sends ? cli::median(incast_ms) : 0.0);
    const double victim_time = cli::max_over_ranks(workers, victim ? cli::median(victim_ms) : 0.0);
    rows.push_back({k, k == 0 ? 0.0 : double(k) * bytes / (slowest_sender * 1e-3) / 1e9,
                    double(bytes) / (victim_time * 1e-3) / 1e9});
  }
  if (rank != 0) rows.clear();
  return rows;
}

void run(const Options& o) {
  std::unique_ptr<ProcessGroup> workers = join_workers();
  require(workers && workers->size() >= 3, ErrorCode::invalid_argument,
          "run it as moka launch -n N -- nvlink_incast with N >= 3 (a receiver, senders, a victim's destination)");
  std::vector<IncastRow> rows;
  try {
    rows = measure(*workers, size_t(o.megabytes) << 20, o.iters);
  } catch (const std::exception& e) {
    workers->abort(e.what());
    throw;
  }
  for (const IncastRow& r : rows)
    std::printf(
        "{\"gpus\": %d, \"megabytes\": %lld, \"iters\": %d, \"senders\": %d, \"receiver_gbs\": %.2f, "
        "\"victim_gbs\": %.2f}\n",
        workers->size(), static_cast<long long>(o.megabytes), o.iters, r.senders, r.receiver_gbs, r.victim_gbs);
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  Options o;
  CLI::App app{"NVSwitch incast: k senders into one GPU and a victim flow (under moka launch -n N, N >= 3)",
               "nvlink_incast"};
  app.add_option("--megabytes", o.megabytes, "Bytes per flow, in MiB")->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  app.add_option("--iters", o.iters, "Timed rounds per sender count (median reported)")->check(CLI::Range(1, 1000000));
  return lab_main(app, argc, argv, [&] { run(o); });
}
