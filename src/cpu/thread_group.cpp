// ProcessGroup over threads of one process: the CPU emulation of N expert-parallel ranks.
// Collectives publish each rank's buffers, meet at a barrier, copy from the peers' buffers and
// meet again so the sources stay valid until every rank has read them.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "moka/error.hpp"
#include "moka/process_group.hpp"

namespace moka {
namespace {

struct Posted {
  const void* send = nullptr;
  const size_t* send_bytes = nullptr;
  const size_t* send_offsets = nullptr;
  size_t gather_bytes = 0;
};

struct SharedState {
  explicit SharedState(int n, double timeout) : size(n), posted(n), timeout_seconds(timeout) {}
  const int size;
  std::vector<Posted> posted;
  const double timeout_seconds;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::string abort_reason;

  // Makes every rank's collectives, waiting or to come, throw peer_failure with `reason` (the
  // first reason given stays).
  void abort(const std::string& reason) {
    std::lock_guard lock(mutex);
    if (!aborted) {
      aborted = true;
      abort_reason = reason;
    }
    cv.notify_all();
  }
};

class ThreadGroup final : public ProcessGroup {
 public:
  ThreadGroup(int rank, SharedState& state) : rank_(rank), state_(state) {}
  int rank() const override { return rank_; }
  int size() const override { return state_.size; }

  void barrier() override {
    std::unique_lock lock(state_.mutex);
    throw_if_aborted();
    const uint64_t gen = state_.generation;
    if (++state_.arrived == state_.size) {
      state_.arrived = 0;
      ++state_.generation;
      state_.cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(state_.timeout_seconds);
    while (state_.generation == gen && !state_.aborted) {
      if (state_.cv.wait_until(lock, deadline) == std::cv_status::timeout && state_.generation == gen &&
          !state_.aborted) {
        throw Error(ErrorCode::timeout, "rank " + std::to_string(rank_) + ": peers did not reach the barrier within " +
                                            std::to_string(state_.timeout_seconds) + " s");
      }
    }
    if (state_.generation == gen) throw_if_aborted();
  }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    post({send, nullptr, nullptr, bytes});
    barrier();
    for (int p = 0; p < state_.size; ++p) {
      const Posted& peer = state_.posted[p];
      require(peer.gather_bytes == bytes, ErrorCode::shape_mismatch,
              "all_gather: rank " + std::to_string(p) + " sent " + std::to_string(peer.gather_bytes) + " bytes, rank " +
                  std::to_string(rank_) + " expected " + std::to_string(bytes));
      std::memcpy(static_cast<char*>(recv) + p * bytes, peer.send, bytes);
    }
    barrier();
  }

  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override {
    post({send, send_bytes, send_offsets, 0});
    barrier();
    for (int p = 0; p < state_.size; ++p) {
      const Posted& peer = state_.posted[p];
      require(peer.send_bytes[rank_] == recv_bytes[p], ErrorCode::shape_mismatch,
              "all_to_all_v: rank " + std::to_string(p) + " sends " + std::to_string(peer.send_bytes[rank_]) +
                  " bytes to rank " + std::to_string(rank_) + ", which expects " + std::to_string(recv_bytes[p]));
      if (recv_bytes[p] == 0) continue;
      std::memcpy(static_cast<char*>(recv) + recv_offsets[p],
                  static_cast<const char*>(peer.send) + peer.send_offsets[rank_], recv_bytes[p]);
    }
    barrier();
  }

  void abort(const std::string& reason) override {
    state_.abort("rank " + std::to_string(rank_) + " failed: " + reason);
  }

 private:
  void post(const Posted& p) {
    std::lock_guard lock(state_.mutex);
    state_.posted[rank_] = p;
  }
  void throw_if_aborted() const {
    if (state_.aborted) throw Error(ErrorCode::peer_failure, state_.abort_reason);
  }

  int rank_;
  SharedState& state_;
};

}  // namespace

void run_emulated_ranks(int world_size, const std::function<void(ProcessGroup&)>& body,
                        const EmulationOptions& options) {
  require(world_size >= 1, ErrorCode::invalid_argument, "world size must be >= 1");
  SharedState state(world_size, options.timeout_seconds);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<char> is_peer_failure(world_size, 0);  // not vector<bool>: ranks write their own entry concurrently
  std::vector<std::thread> threads;
  threads.reserve(world_size);  // so that emplace_back can fail only at starting a thread
  std::string start_failure;
  for (int r = 0; r < world_size; ++r) {
    const auto run_rank = [&, r] {
      ThreadGroup group(r, state);
      try {
        body(group);
      } catch (const Error& e) {
        errors[r] = std::current_exception();
        is_peer_failure[r] = e.code() == ErrorCode::peer_failure;
        group.abort(e.what());
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        group.abort(e.what());
      }
    };
    try {
      threads.emplace_back(run_rank);
    } catch (const std::system_error& e) {
      // The limit on processes and threads (ulimit -u, a container's pids.max) or the memory for
      // thread stacks is reached. The ranks started wait for this one in their collectives:
      // abort the group so that they stop, then join them (a joinable std::thread destroyed
      // would end the process in std::terminate).
      start_failure = "cannot start the thread of emulated rank " + std::to_string(r) + " of " +
                      std::to_string(world_size) + ": " + e.what() +
                      " (the limit on processes and threads, ulimit -u, or memory for thread stacks)";
      state.abort(start_failure);
      break;
    }
  }
  for (auto& t : threads) t.join();
  require(start_failure.empty(), ErrorCode::capacity_exceeded, start_failure);
  // Report the root cause: the first rank that failed on its own, not through a peer.
  for (int r = 0; r < world_size; ++r)
    if (errors[r] && !is_peer_failure[r]) std::rethrow_exception(errors[r]);
  for (int r = 0; r < world_size; ++r)
    if (errors[r]) std::rethrow_exception(errors[r]);
}

}  // namespace moka
