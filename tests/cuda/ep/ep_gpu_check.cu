// GPU checks of the device group, run as N worker processes on N GPUs:
//   moka launch -n 2 -- build/tests/cuda/moka_ep_gpu_check
// NCCL all-to-all-v with random sizes, symmetric memory loads and stores across GPUs ordered by
// the device barrier, barrier replay in a CUDA graph, and a barrier timeout naming the rank; the
// layer on the all-to-all path and on the megakernel path (forward and backward megakernels)
// against the fp64 CPU reference of the group.
//
// GoogleTest with a main of its own: every rank runs every test, in the same order, and the tests
// make collective calls. So a failed check is an EXPECT, never an ASSERT (which would leave the
// rest of its test's collectives to the peers alone), and an exception leaves RUN_ALL_TESTS and
// aborts the group, so that the peers stop with peer_failure instead of hanging. At the end the
// ranks agree: each exits non-zero when any rank's test failed. Each output line names its rank.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/cuda_check.hpp"
#include "cuda/common/device_memory.hpp"
#include "core/routing_gen.hpp"
#include "cuda/cuda_backend.hpp"
#include "gpu_case.hpp"
#include "moka/device_group.hpp"
#include "moka/distributed.hpp"
#include "moka/moka.hpp"

using namespace moka;

namespace {

// The group the tests run on, made by main from the environment `moka launch` sets.
int g_rank = 0;
ProcessGroup* g_host = nullptr;
DeviceGroup* g_devices = nullptr;
ProcessGroup& host_group() { return *g_host; }
DeviceGroup& device_group() { return *g_devices; }

// Each line of `text` on `out`, prefixed with this rank (the ranks' lines interleave in one log).
void print_lines(FILE* out, const std::string& text) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) std::fprintf(out, "rank %d: %s\n", g_rank, line.c_str());
  std::fflush(out);
}

// A measured relative error within `tolerance`, printed either way: scripts/gpu.sh's summary of
// a run lists every error measured.
void expect_within(double error, double tolerance, const std::string& what) {
  print_lines(stdout, what + " relative error " + std::to_string(error));
  EXPECT_LE(error, tolerance) << what << " relative error " << error;
}

// gtest's progress lines and failures, each line prefixed with the rank; replaces its default
// printer. The last line counts this rank's passed and failed tests.
class RankPrinter : public testing::EmptyTestEventListener {
  static std::string name_of(const testing::TestInfo& t) { return std::string(t.test_suite_name()) + "." + t.name(); }
  void OnTestStart(const testing::TestInfo& t) override { print_lines(stdout, "[ RUN      ] " + name_of(t)); }
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::string where = r.file_name() == nullptr ? "unknown file" : r.file_name();
    if (r.line_number() >= 0) where += ":" + std::to_string(r.line_number());
    print_lines(stderr, where + ": Failure\n" + r.message());
  }
  void OnTestEnd(const testing::TestInfo& t) override {
    print_lines(stdout, std::string(t.result()->Failed() ? "[  FAILED  ] " : "[       OK ] ") + name_of(t) + " (" +
                            std::to_string(t.result()->elapsed_time()) + " ms)");
  }
  void OnTestProgramEnd(const testing::UnitTest& u) override {
    print_lines(stdout, std::to_string(u.successful_test_count()) + " passed, " +
                            std::to_string(u.failed_test_count()) + " failed");
  }
};

// Rank s sends count(s, d) int32 values s*1000 + d*10 + i%7 to rank d; sizes vary per call.
void all_to_all_v_matches(DeviceGroup& g, ProcessGroup& host, uint64_t seed) {
  const int R = g.size(), me = g.rank();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int> counts(R * R);
  for (auto& c : counts) c = static_cast<int>(rng() % 5000);  // same table on every rank (same seed)
  counts[0] = 0;                                              // an empty pair
  std::vector<size_t> sb(R), so(R), rb(R), ro(R);
  std::vector<int32_t> send;
  for (int d = 0; d < R; ++d) {
    so[d] = send.size() * 4;
    sb[d] = counts[me * R + d] * 4;
    for (int i = 0; i < counts[me * R + d]; ++i) send.push_back(me * 1000 + d * 10 + i % 7);
  }
  size_t total = 0;
  for (int s = 0; s < R; ++s) {
    ro[s] = total;
    rb[s] = counts[s * R + me] * 4;
    total += rb[s];
  }
  cuda::DeviceArray<int32_t> d_send(send.size() + 1), d_recv(total / 4 + 1);
  MOKA_CUDA_CHECK(cudaMemset(d_recv.data(), 0xff, d_recv.bytes()));  // poison
  d_send.upload(send, cudaStreamLegacy);
  g.all_to_all_v(d_send.data(), sb.data(), so.data(), d_recv.data(), rb.data(), ro.data(), nullptr);
  std::vector<int32_t> recv(total / 4);
  MOKA_CUDA_CHECK(cudaMemcpy(recv.data(), d_recv.data(), total, cudaMemcpyDeviceToHost));
  bool ok = true;
  size_t i = 0;
  for (int s = 0; s < R; ++s)
    for (int c = 0; c < counts[s * R + me]; ++c) ok &= recv[i++] == s * 1000 + me * 10 + c % 7;
  EXPECT_TRUE(ok) << "all_to_all_v seed " << seed;
  host.barrier();
}

__global__ void store_to_peers(void** peers, int world, int me, int n) {
  // Rank `me` writes its block of every peer's buffer: word [me * n + i] = me * 1'000'000 + i.
  for (int p = 0; p < world; ++p) {
    int* dst = static_cast<int*>(peers[p]) + me * n;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = me * 1000000 + i;
  }
}

void symmetric_stores_are_visible_after_the_barrier(DeviceGroup& g) {
  const int R = g.size(), me = g.rank(), n = 1 << 20;
  const SymmetricBuffer& buf = g.allocate_symmetric(size_t(R) * n * sizeof(int));
  cudaStream_t s;
  MOKA_CUDA_CHECK(cudaStreamCreate(&s));
  g.device_barrier(s, 10.0);  // peers mapped and zeroed before anyone stores
  store_to_peers<<<64, 256, 0, s>>>(buf.peers_device, R, me, n);
  MOKA_CUDA_CHECK(cudaGetLastError());
  g.device_barrier(s, 10.0);
  std::vector<int> local(size_t(R) * n);
  MOKA_CUDA_CHECK(cudaMemcpyAsync(local.data(), buf.local, local.size() * 4, cudaMemcpyDeviceToHost, s));
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  g.check_device_errors();
  bool ok = true;
  for (int p = 0; p < R; ++p)
    for (int i = 0; i < n; i += 997) ok &= local[size_t(p) * n + i] == p * 1000000 + i;
  EXPECT_TRUE(ok) << "peer stores visible after the device barrier";
  // Loads from a peer's buffer (pull direction).
  const int peer = (me + 1) % R;
  std::vector<int> pulled(n);
  MOKA_CUDA_CHECK(cudaMemcpy(pulled.data(), static_cast<int*>(buf.peers[peer]) + me * n, n * 4, cudaMemcpyDefault));
  EXPECT_EQ(pulled[12345], me * 1000000 + 12345) << "load from a peer's symmetric buffer";
  g.device_barrier(s, 10.0);  // nobody frees or reuses before everyone has read
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaStreamDestroy(s);
}

void barrier_replays_in_a_cuda_graph(DeviceGroup& g) {
  cudaStream_t s;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOKA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  g.device_barrier(s, 10.0);
  MOKA_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOKA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 5; ++i) MOKA_CUDA_CHECK(cudaGraphLaunch(exec, s));
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  bool ok = true;
  try {
    g.check_device_errors();
  } catch (const Error&) {
    ok = false;
  }
  EXPECT_TRUE(ok) << "barrier replayed 5 times from a CUDA graph";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

enum class Skew { uniform, zipf, all_to_rank0 };

// Every rank's inputs, identical in every process (seeded), so each process can run the CPU
// reference of the whole group and check its own rank's GPU results against it.
std::vector<cli::LayerBuffers<double>> group_inputs(const MoeShape& s, int world, int64_t T, uint64_t seed, Skew skew) {
  std::vector<cli::LayerBuffers<double>> ranks;
  for (int r = 0; r < world; ++r) {
    cli::LayerBuffers<double> b(s, world, T);
    b.randomize(seed * 131 + r);
    const auto kind = skew == Skew::zipf ? core::RoutingKind::zipf : core::RoutingKind::uniform;
    // all_to_rank0: ids drawn among rank 0's experts only, so the other ranks receive nothing.
    const int64_t experts = skew == Skew::all_to_rank0 ? s.num_experts / world : s.num_experts;
    b.topk_ids = core::sample_topk_ids({kind, 0.35, seed}, T, s.top_k, experts, r);
    ranks.push_back(std::move(gpu_test::GpuCase(std::move(b)).ref));  // bf16-rounded inputs
  }
  return ranks;
}

// The fp64 CPU reference layer run over the whole group (ranks as threads) on these inputs:
// forward, and backward too when asked.
std::vector<cli::LayerBuffers<double>> reference_of(const MoeShape& s, std::vector<cli::LayerBuffers<double>> ranks,
                                                    bool backward) {
  run_emulated_ranks(static_cast<int>(ranks.size()), [&](ProcessGroup& g) {
    auto layer = make_moe_layer(s, Backend::cpu, &g, LayerOptions{128, 1});
    auto& b = ranks[g.rank()];
    auto ctx = layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{});
    if (backward) layer->backward(*ctx, b.d_out_view(), b.weights(), b.gradients(), Stream{});
  });
  return ranks;
}

// Out and every gradient this rank's GPU case holds, within 2e-2 relative error of its reference.
void outputs_match(const gpu_test::GpuCase& c, const cli::LayerBuffers<double>& ref, const char* name) {
  const char* names[] = {"out",      "d_x",       "d_topk_weights", "d_w_gate", "d_w_up",
                         "d_w_down", "d_ws_gate", "d_ws_up",        "d_ws_down"};
  const auto got = c.download();
  const auto g_out = got.outputs();
  const auto r_out = ref.outputs();
  for (size_t i = 0; i < g_out.size(); ++i) {
    if (r_out[i]->empty()) continue;
    expect_within(cli::max_rel_error(*g_out[i], *r_out[i]), 2e-2, std::string(name) + ": " + names[i]);
  }
}

// The expert-parallel CUDA layer (NCCL all-to-all path) against the fp64 CPU reference of the
// same group, forward and every gradient, with poisoned outputs; then 3 more runs bitwise equal.
void layer_matches_reference(ProcessGroup& host, const MoeShape& s, int64_t T, Skew skew, const char* name) {
  const int R = host.size(), me = host.rank();
  auto ranks = group_inputs(s, R, T, 17 + T, skew);
  const auto ref = reference_of(s, ranks, true);
  gpu_test::GpuCase c(ranks[me]);
  c.upload();
  auto layer = make_moe_layer(s, Backend::cuda, &host, LayerOptions{128, 0});
  auto run = [&] {
    c.poison();
    auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
    layer->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  };
  run();
  outputs_match(c, ref[me], name);
  const auto bits = c.output_bytes();
  bool same = true;
  for (int i = 0; i < 3; ++i) {
    run();
    same &= c.output_bytes() == bits;
  }
  EXPECT_TRUE(same) << name << ": 3 more runs give identical bits";
  host.barrier();
}

// 4 experts per rank, k = 2: the cases of the input-error checks.
MoeShape small_shape(const ProcessGroup& host) {
  return MoeShape{256, 128, 4 * int64_t(host.size()), 2, 0, Activation::swiglu, 7.0f};
}

// Every rank's 64 tokens, with an expert id out of range at rank 1's token 3, choice 1.
std::vector<cli::LayerBuffers<double>> bad_routing_on_rank1(const ProcessGroup& host, const MoeShape& s) {
  auto ranks = group_inputs(s, host.size(), 64, 5, Skew::uniform);
  ranks[1].topk_ids[7] = 99;
  return ranks;
}

// A bad input on one rank (an expert id out of range on rank 1) stops the call on every rank
// with the same error naming rank 1, before any rows move; the layer stays usable afterwards.
void bad_routing_on_one_rank_is_reported_everywhere(ProcessGroup& host) {
  const MoeShape s = small_shape(host);
  const int me = host.rank();
  gpu_test::GpuCase c(bad_routing_on_rank1(host, s)[me]);
  c.upload();
  auto layer = make_moe_layer(s, Backend::cuda, &host, LayerOptions{128, 0});
  std::string error;
  try {
    layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_TRUE(error.find("expert id out of range") != std::string::npos && error.find("rank 1") != std::string::npos &&
              error.find("[3, 1]") != std::string::npos)
      << "bad routing on rank 1 reported here: " << error;
  gpu_test::GpuCase good(group_inputs(s, host.size(), 64, 6, Skew::uniform)[me]);
  good.upload();
  bool recovered = true;
  try {
    auto ctx = layer->forward(good.inputs(), good.weights(), good.out_view(), Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const Error&) {
    recovered = false;
  }
  EXPECT_TRUE(recovered) << "the layer runs again after the error";
  host.barrier();
}

using gpu_test::megakernel_config;

// The forward megakernel across the group against the fp64 CPU reference of the same group
// (poisoned output), then bitwise equal across 3 more runs, other SM splits, minibatch and
// macrobatch sizes (a ring smaller than the routed rows included) and a CUDA-graph replay.
void megakernel_matches_reference(ProcessGroup& host, DeviceGroup& g, const MoeShape& s, int64_t T, Skew skew,
                                  const char* name) {
  const int R = host.size(), me = host.rank();
  auto ranks = group_inputs(s, R, T, 29 + T, skew);
  const auto ref = reference_of(s, ranks, false);
  gpu_test::GpuCase c(ranks[me]);
  c.upload();
  auto run = [&](MoeLayer& mk) {
    c.poison();
    mk.forward(c.inputs(), c.weights(), c.out_view(), Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    mk.check_errors();
    return gpu_test::bytes_of(c.out);
  };
  auto mk = make_moe_layer(s, &g, gpu_test::megakernel_options(megakernel_config(32, 4096, 131072), T));
  const auto bits = run(*mk);
  expect_within(cli::max_rel_error(c.download().out, ref[me].out), 2e-2, std::string(name) + ": megakernel out");
  bool same = true;
  for (int i = 0; i < 3; ++i) same &= run(*mk) == bits;
  for (const auto& cfg :
       {megakernel_config(1, 128, 128), megakernel_config(8, 256, 512), megakernel_config(64, 1024, 2048)}) {
    auto other = make_moe_layer(s, &g, gpu_test::megakernel_options(cfg, T));
    same &= run(*other) == bits;
  }
  EXPECT_TRUE(same) << name << ": megakernel bits equal over runs, SM splits and batch sizes";

  bool replayed = true;
  c.poison();
  gpu_test::replay_in_graph([&](Stream s) { mk->forward(c.inputs(), c.weights(), c.out_view(), s); }, 3,
                            [&](int) {
                              mk->check_errors();
                              replayed &= gpu_test::bytes_of(c.out) == bits;
                              c.poison();
                            });
  EXPECT_TRUE(replayed) << name << ": megakernel CUDA-graph replay gives the same bits";
  host.barrier();
}

// The message of the error a layer call raises once the device is done ("" when none).
std::string error_of(MoeLayer& layer, const std::function<void()>& call) {
  std::string error;
  try {
    call();
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    layer.check_errors();
  } catch (const Error& e) {
    error = e.what();
  }
  return error;
}

// Input errors found on the device are reported on every rank, naming the rank whose input is
// bad: an expert id out of range on rank 1, then token counts that disagree. At EP >= 4, a
// routing that sends everything to rank 0 overflows a small capacity and is reported as such.
void megakernel_input_errors_are_reported_everywhere(ProcessGroup& host, DeviceGroup& g) {
  const MoeShape s = small_shape(host);
  const int me = host.rank();
  gpu_test::GpuCase c(bad_routing_on_rank1(host, s)[me]);
  c.upload();
  auto mk = make_moe_layer(s, &g, gpu_test::megakernel_options(megakernel_config(8, 256, 512), 64));
  std::string error = error_of(*mk, [&] { mk->forward(c.inputs(), c.weights(), c.out_view(), Stream{}); });
  EXPECT_TRUE(error.find("routing of rank 1") != std::string::npos &&
              error.find("token 3, choice 1") != std::string::npos)
      << "megakernel: bad expert id on rank 1 reported here: " << error;
  gpu_test::GpuCase good(group_inputs(s, host.size(), 64, 6, Skew::uniform)[me]);
  good.upload();
  auto inputs = good.inputs();
  auto out = good.out_view();
  if (me == 1) {  // rank 1 passes its first 63 tokens only
    for (TensorView* v : {&inputs.x, &inputs.topk_ids, &inputs.topk_weights}) v->shape[0] = 63;
    out.shape[0] = 63;
  }
  error = error_of(*mk, [&] { mk->forward(inputs, good.weights(), out, Stream{}); });
  EXPECT_TRUE(error.find("token counts disagree") != std::string::npos &&
              error.find("rank 1 has 63") != std::string::npos)
      << "megakernel: token counts that disagree are reported here: " << error;
  error = error_of(*mk, [&] { mk->forward(good.inputs(), good.weights(), good.out_view(), Stream{}); });
  EXPECT_TRUE(error.empty()) << "megakernel runs again after the errors: " << error;
  if (host.size() >= 4) {
    gpu_test::GpuCase skewed(group_inputs(s, host.size(), 64, 7, Skew::all_to_rank0)[me]);
    skewed.upload();
    MegakernelConfig small = megakernel_config(8, 256, 512);
    small.capacity_multiplier = 0.25;
    auto tight = make_moe_layer(s, &g, gpu_test::megakernel_options(small, 64));
    const std::string overflow =
        error_of(*tight, [&] { tight->forward(skewed.inputs(), skewed.weights(), skewed.out_view(), Stream{}); });
    EXPECT_TRUE(overflow.find("rank 0") != std::string::npos && overflow.find("capacity") != std::string::npos)
        << "megakernel: capacity overflow on rank 0 reported here: " << overflow;
  }
  host.barrier();
}

// The megakernel path of MoeLayer over the group, forward and backward through both megakernels
// (resident context when the forward's ring holds every row, replay when `macrobatch` is
// smaller), against the fp64 CPU reference of the same group: out and every gradient, on
// poisoned outputs; then the same bits in another run and in every replay of fwd+bwd captured
// in one CUDA graph. The forward's out also equals the all-to-all path's bit for bit (the
// gradients do not: the backward megakernel sums in another order).
void megakernel_path_matches_reference(ProcessGroup& host, DeviceGroup& g, const MoeShape& s, int64_t T, Skew skew,
                                       int64_t macrobatch, const char* name) {
  const int me = host.rank();
  auto ranks = group_inputs(s, host.size(), T, 41 + T, skew);
  const auto ref = reference_of(s, ranks, true);
  gpu_test::GpuCase c(ranks[me]);
  c.upload();
  const auto all_to_all_out = [&] {
    LayerOptions options{128, 0};
    options.path = LayerPath::all_to_all;
    auto staged = make_moe_layer(s, &g, options);
    c.poison();
    staged->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    staged->check_errors();
    return gpu_test::bytes_of(c.out);
  }();
  auto mk = make_moe_layer(s, &g, gpu_test::megakernel_options(megakernel_config(16, 256, macrobatch), T));
  auto step = [&](Stream stream) {
    auto ctx = mk->forward(c.inputs(), c.weights(), c.out_view(), stream);
    mk->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), stream);
  };
  auto run = [&] {
    c.poison();
    step(Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    mk->check_errors();
    return c.output_bytes();
  };
  EXPECT_TRUE(mk->megakernel() != nullptr) << name << ": the layer takes the megakernel path";
  const auto bits = run();
  outputs_match(c, ref[me], name);
  EXPECT_TRUE(gpu_test::bytes_of(c.out) == all_to_all_out) << name << ": forward out equals the all-to-all path's bits";
  EXPECT_TRUE(run() == bits) << name << ": another fwd+bwd gives identical bits";
  bool replayed = true;
  c.poison();
  gpu_test::replay_in_graph(step, 3, [&](int) {
    mk->check_errors();
    replayed &= c.output_bytes() == bits;
    c.poison();
  });
  EXPECT_TRUE(replayed) << name << ": fwd+bwd replayed in one CUDA graph gives the same bits";
  host.barrier();
}

// Rank 0 calls the megakernel alone: its barrier before the pulls times out, and the kernel must
// not read peer x that no one froze. The status it reports says so and names a missing rank
// (the layer is built collectively; the other ranks then stay away).
void megakernel_reads_no_peer_rows_after_a_barrier_timeout(ProcessGroup& host, DeviceGroup& g) {
  const MoeShape s = small_shape(host);
  gpu_test::GpuCase c(group_inputs(s, host.size(), 64, 8, Skew::uniform)[host.rank()]);
  c.upload();
  MegakernelConfig cfg = megakernel_config(8, 256, 512);
  cfg.spin_timeout_seconds = 0.2;
  auto mk = make_moe_layer(s, &g, gpu_test::megakernel_options(cfg, 64));
  host.barrier();
  if (g.rank() != 0) return;
  const std::string error = error_of(*mk, [&] { mk->forward(c.inputs(), c.weights(), c.out_view(), Stream{}); });
  EXPECT_TRUE(error.find("no peer rows were read") != std::string::npos &&
              error.find("did not arrive") != std::string::npos &&
              error.find("rank 0 did not arrive") == std::string::npos)
      << "megakernel after a barrier timeout reads no peer rows: " << error;
}

// Last: only rank 0 enters the barrier; it must time out and name a missing rank (the error
// word is already set by the test before; it keeps the first missing rank).
void missing_peer_times_out(DeviceGroup& g) {
  if (g.rank() != 0) return;
  g.device_barrier(nullptr, 0.5);
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  std::string error;
  try {
    g.check_device_errors();
  } catch (const Error& e) {
    error = e.what();
  }
  // Every other rank stays away; whichever peer's wait expires first is the one named.
  const bool names_a_peer =
      error.find("did not arrive") != std::string::npos && error.find("rank 0 did not arrive") == std::string::npos;
  EXPECT_TRUE(names_a_peer) << "barrier timeout names a missing rank: " << error;
}

// 4 experts per rank at any world size, so "everything to rank 0's experts" still has k distinct ones.
MoeShape shaped() { return MoeShape{256, 128, 4 * int64_t(host_group().size()), 2, 128, Activation::swiglu, 7.0f}; }
// One token with k = 8 and the clamped activation.
MoeShape clamped_k8() {
  return MoeShape{512, 256, 8 * int64_t(host_group().size()), 8, 0, Activation::swiglu_clamped, 7.0f};
}

}  // namespace

// The tests run in the order written here (gtest keeps each suite's tests together, suites in
// the order they first appear): the timeout checks come last, rank 0 alone.

TEST(EpAllToAll, RandomSizesArriveWhole) {
  for (uint64_t seed = 1; seed <= 3; ++seed) all_to_all_v_matches(device_group(), host_group(), seed);
}

TEST(EpLayer, MatchesReferenceUniform) {
  layer_matches_reference(host_group(), shaped(), 300, Skew::uniform, "EP layer, uniform");
}
TEST(EpLayer, MatchesReferenceZipf) {
  layer_matches_reference(host_group(), shaped(), 300, Skew::zipf, "EP layer, zipf");
}
TEST(EpLayer, MatchesReferenceWithARankReceivingNothing) {
  layer_matches_reference(host_group(), shaped(), 77, Skew::all_to_rank0, "EP layer, a rank receiving nothing");
}
TEST(EpLayer, MatchesReferenceOneTokenK8Clamped) {
  layer_matches_reference(host_group(), clamped_k8(), 1, Skew::uniform, "EP layer, T=1 k=8 clamped");
}
TEST(EpLayer, BadRoutingOnOneRankIsReportedEverywhere) { bad_routing_on_one_rank_is_reported_everywhere(host_group()); }

TEST(EpMegakernel, MatchesReferenceUniform) {
  megakernel_matches_reference(host_group(), device_group(), shaped(), 300, Skew::uniform, "megakernel, uniform");
}
TEST(EpMegakernel, MatchesReferenceZipf) {
  megakernel_matches_reference(host_group(), device_group(), shaped(), 300, Skew::zipf, "megakernel, zipf");
}
TEST(EpMegakernel, MatchesReferenceWithARankReceivingNothing) {
  megakernel_matches_reference(host_group(), device_group(), shaped(), 77, Skew::all_to_rank0,
                               "megakernel, a rank receiving nothing");
}
TEST(EpMegakernel, MatchesReferenceOneTokenK8Clamped) {
  megakernel_matches_reference(host_group(), device_group(), clamped_k8(), 1, Skew::uniform,
                               "megakernel, T=1 k=8 clamped");
}
TEST(EpMegakernel, MatchesReferenceQwen3DimsZipf) {
  const MoeShape qwen3_dims{2048, 768, 8 * int64_t(host_group().size()), 8, 0, Activation::swiglu, 7.0f};
  megakernel_matches_reference(host_group(), device_group(), qwen3_dims, 1000, Skew::zipf,
                               "megakernel, qwen3-30b dims zipf");
}

TEST(EpMegakernelPath, ResidentUniform) {
  megakernel_path_matches_reference(host_group(), device_group(), shaped(), 300, Skew::uniform, 1 << 20,
                                    "megakernel fwd+bwd, resident, uniform");
}
TEST(EpMegakernelPath, ReplayZipf) {
  megakernel_path_matches_reference(host_group(), device_group(), shaped(), 300, Skew::zipf, 512,
                                    "megakernel fwd+bwd, replay, zipf");
}
TEST(EpMegakernelPath, ResidentWithARankReceivingNothing) {
  megakernel_path_matches_reference(host_group(), device_group(), shaped(), 77, Skew::all_to_rank0, 1 << 20,
                                    "megakernel fwd+bwd, a rank receiving nothing");
}
TEST(EpMegakernelPath, ReplayWithARankReceivingNothing) {
  megakernel_path_matches_reference(host_group(), device_group(), shaped(), 77, Skew::all_to_rank0, 256,
                                    "megakernel fwd+bwd, replay, a rank receiving nothing");
}
TEST(EpMegakernelPath, ResidentOneTokenK8Clamped) {
  megakernel_path_matches_reference(host_group(), device_group(), clamped_k8(), 1, Skew::uniform, 1 << 20,
                                    "megakernel fwd+bwd, T=1 k=8 clamped");
}

TEST(EpMegakernelInputs, ErrorsAreReportedEverywhere) {
  megakernel_input_errors_are_reported_everywhere(host_group(), device_group());
}

TEST(EpDeviceBarrier, SymmetricStoresAreVisibleAfterTheBarrier) {
  symmetric_stores_are_visible_after_the_barrier(device_group());
}
TEST(EpDeviceBarrier, ReplaysInACudaGraph) { barrier_replays_in_a_cuda_graph(device_group()); }

TEST(EpTimeouts, MegakernelReadsNoPeerRowsAfterABarrierTimeout) {
  host_group().barrier();  // every rank is done with the collective tests before rank 0 goes on alone
  megakernel_reads_no_peer_rows_after_a_barrier_timeout(host_group(), device_group());
}
TEST(EpTimeouts, MissingPeerTimesOut) { missing_peer_times_out(device_group()); }

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  if (GTEST_FLAG_GET(list_tests)) return RUN_ALL_TESTS();  // listing needs no group
  const Rendezvous rv = rendezvous_from_env();
  require(rv.world_size >= 2, ErrorCode::invalid_argument, "run under `moka launch -n 2` (or torchrun)");
  g_rank = rv.rank;
  testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankPrinter);
  // An exception is not a test failure here: it leaves RUN_ALL_TESTS, and this rank aborts the
  // group below instead of going on to collectives its peers may never reach.
  GTEST_FLAG_SET(catch_exceptions, false);
  auto host = make_tcp_group(rv);
  try {
    int device_count = 0;
    MOKA_CUDA_CHECK(cudaGetDeviceCount(&device_count));
    require(device_count >= rv.world_size, ErrorCode::invalid_argument, "needs one GPU per rank");
    MOKA_CUDA_CHECK(cudaSetDevice(rv.local_rank));
    auto devices = make_nccl_group(*host, rv.local_rank);
    g_host = host.get();
    g_devices = devices.get();
    const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    // Every rank waits here for the others (rank 0 runs the last tests alone) and learns whether
    // any rank failed, so that every rank's exit code says so.
    std::vector<int> failed_on(rv.world_size);
    host->all_gather(&failed, failed_on.data(), sizeof(int));
    return std::count(failed_on.begin(), failed_on.end(), 1) > 0 ? 1 : 0;
  } catch (const std::exception& e) {
    print_lines(stderr, e.what());
    host->abort(e.what());
    return 2;
  }
}
