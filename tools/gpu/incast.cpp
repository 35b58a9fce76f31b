// `moka incast` on the GPU: k senders into one GPU with a victim flow, through peer copies.
#include "gpu/bench_timing.hpp"

namespace moka::cli {
namespace {

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

}  // namespace

std::vector<IncastRow> run_incast(ProcessGroup& workers, size_t bytes, int iters) {
  const int R = workers.size(), rank = workers.rank();
  require(R >= 3, ErrorCode::invalid_argument, "moka incast needs at least 3 GPUs (a receiver, senders, a victim's destination)");
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  auto group = make_nccl_group(workers, device);
  const SymmetricBuffer& inbox = group->allocate_symmetric(bytes * R);  // slot s: from rank s
  Dev src(bytes), victim_src(bytes);
  cudaStream_t incast_stream, victim_stream;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&incast_stream, cudaStreamNonBlocking));
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&victim_stream, cudaStreamNonBlocking));
  auto copy_to = [&](int peer, const Dev& from, cudaStream_t s) {
    char* slot = static_cast<char*>(inbox.peers[peer]) + size_t(rank) * bytes;
    MOKA_CUDA_CHECK(cudaMemcpyAsync(slot, from.data(), bytes, cudaMemcpyDeviceToDevice, s));
  };
  std::vector<IncastRow> rows;
  for (int k = 0; k < R; ++k) {
    const bool sends = rank >= 1 && rank <= k, victim = rank == 1;
    std::vector<double> incast_ms, victim_ms;
    for (int i = 0; i < iters + 1; ++i) {  // the first round warms up
      workers.barrier();  // the flows start together (host barrier: tens of us against ms copies)
      // Both of rank 1's flows are in flight together, each timed on its own stream.
      Flow incast, victim_flow;
      if (sends) incast.start(incast_stream), copy_to(0, src, incast_stream), incast.stop(incast_stream);
      if (victim) victim_flow.start(victim_stream), copy_to(R - 1, victim_src, victim_stream), victim_flow.stop(victim_stream);
      if (i > 0) incast_ms.push_back(sends ? incast.ms() : 0), victim_ms.push_back(victim ? victim_flow.ms() : 0);
    }
    const double slowest_sender = max_over_ranks(workers, sends ? median(incast_ms) : 0.0);
    const double victim_time = max_over_ranks(workers, victim ? median(victim_ms) : 0.0);
    rows.push_back({k, k == 0 ? 0.0 : double(k) * bytes / (slowest_sender * 1e-3) / 1e9,
                    double(bytes) / (victim_time * 1e-3) / 1e9});
  }
  MOKA_CUDA_CHECK(cudaStreamDestroy(incast_stream));
  MOKA_CUDA_CHECK(cudaStreamDestroy(victim_stream));
  if (rank != 0) rows.clear();
  return rows;
}

}  // namespace moka::cli
