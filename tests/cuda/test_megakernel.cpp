// The forward megakernel on one GPU (EP = 1, dispatch pulls from this GPU's own x) against the
// fp64 CPU reference on bf16-rounded inputs: fresh random inputs, poisoned outputs, the named
// shapes' hidden/intermediate sizes, skewed routing; bitwise determinism across runs and across
// SM splits, minibatch and macrobatch sizes (including ring reuse); CUDA-graph replay; errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <random>

#include "core/routing_gen.hpp"
#include "core/megakernel_memory.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/layer_paths.hpp"
#include "cuda/megakernel/gemm_core.hpp"
#include "cuda/megakernel/launch.hpp"
#include "gpu_case.hpp"
#include "grouped_schedule.hpp"
#include "moka/moka.hpp"

using namespace moka;
using gpu_test::GpuCase;

namespace {

using gpu_test::fresh_seed;
using gpu_test::shape;

const auto U = core::RoutingKind::uniform;
const auto Z = core::RoutingKind::zipf;
const auto ONE = core::RoutingKind::one_expert;

// Routes the case's tokens and uploads it (outputs poisoned).
void route_and_upload(GpuCase& c, core::RoutingKind kind, uint64_t seed) {
  const MoeShape& s = c.ref.shape;
  c.ref.topk_ids = core::sample_topk_ids({kind, 0.5, seed}, c.ref.tokens, s.top_k, s.num_experts);
  c.upload();
}

void forward(MoeLayer& mk, GpuCase& c) {
  c.poison();
  mk.forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  mk.check_errors();
}

using gpu_test::bytes_of;
using gpu_test::DeviceTensor;

double forward_error(GpuCase& c, MoeLayer& mk) {
  forward(mk, c);
  const auto got = c.download();
  auto cpu = make_moe_layer(c.ref.shape, Backend::cpu);
  cpu->forward(c.ref.inputs(), c.ref.weights(), c.ref.out_view(), Stream{});
  return cli::max_rel_error(got.out, c.ref.out);
}

using gpu_test::megakernel_config;

struct Case {
  const char* name;
  MoeShape shape;
  int64_t tokens;
  core::RoutingKind routing;
  MegakernelConfig cfg;
};

class MegakernelVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(MegakernelVsReference, Forward) {
  const Case& p = GetParam();
  const uint64_t seed = fresh_seed();
  GpuCase c(p.shape, p.tokens, seed);
  route_and_upload(c, p.routing, seed + 1);
  auto mk = make_moe_layer(p.shape, nullptr, gpu_test::megakernel_options(p.cfg, p.tokens));
  EXPECT_LE(forward_error(c, *mk), 2e-2);
  // Bit for bit the single-GPU path's output: every element sees the same K order.
  const auto bits = bytes_of(c.out);
  LayerOptions single;
  single.path = LayerPath::single_gpu;
  auto staged = make_moe_layer(p.shape, nullptr, single);
  forward(*staged, c);
  EXPECT_TRUE(bytes_of(c.out) == bits) << "the megakernel's output differs from the single-GPU path's";
}

const MegakernelConfig kDefault = megakernel_config(32, 4096, 131072);
// Many macrobatches through a 512-row ring.
const MegakernelConfig kRingReuse = megakernel_config(4, 256, 512);

INSTANTIATE_TEST_SUITE_P(
    Shapes, MegakernelVsReference,
    ::testing::Values(Case{"tiny_T1", shape(256, 128, 16, 4, 128), 1, U, kDefault},
                      Case{"tiny_T37", shape(256, 128, 16, 4, 128), 37, U, kDefault},
                      Case{"tiny_T300_zipf_ring_reuse", shape(256, 128, 16, 4, 128), 300, Z, kRingReuse},
                      Case{"k1_all_on_one_expert", shape(256, 128, 16, 1), 200, ONE, kRingReuse},  // 15 empty experts
                      Case{"k8_ring_reuse", shape(256, 192, 16, 8), 129, U, kRingReuse},
                      Case{"clamped", shape(512, 256, 8, 2, 0, true), 100, U, kDefault},
                      // H = 384: the last down tile's second 128-row weight box lies past H (reloads the last).
                      Case{"half_down_tile", shape(384, 256, 8, 2, 128), 70, U, kRingReuse},
                      // H = 264, I = 136, Is = 72: the last 64-column output box of y, of gate, up and hidden and
                      // of the shared expert's outputs lies partly past the matrix (the TMA store clips it).
                      Case{"ragged_widths", shape(264, 136, 8, 2, 72), 45, U, kDefault},
                      Case{"qwen3_30b_dims", shape(2048, 768, 8, 8), 48, U, kDefault},
                      Case{"qwen3_235b_dims", shape(4096, 1536, 4, 2), 40, U, kRingReuse},
                      Case{"deepseek_v3_dims", shape(7168, 2048, 4, 2, 2048), 24, U, kDefault},
                      Case{"gpt_oss_dims", shape(2880, 2880, 4, 2, 0, true), 40, U, kRingReuse},
                      Case{"mixtral_dims", shape(4096, 14336, 2, 1), 20, U, kDefault},
                      Case{"many_tokens_zipf", shape(1024, 512, 32, 4, 256), 3000, Z,
                           megakernel_config(16, 1024, 4096)}),
    [](const auto& info) { return std::string(info.param.name); });

// Same bits for 10 runs and for every SM split / minibatch / macrobatch (the ring reused or not).
TEST(Megakernel, BitsDoNotDependOnRunsSplitsOrBatchSizes) {
  const MoeShape s = shape(1024, 512, 32, 8, 256);
  const int64_t T = 1000;
  const uint64_t seed = fresh_seed();
  GpuCase c(s, T, seed);
  route_and_upload(c, Z, seed + 1);
  auto first = make_moe_layer(s, nullptr, gpu_test::megakernel_options(kDefault, T));
  forward(*first, c);
  const auto bits = bytes_of(c.out);
  for (int i = 0; i < 9; ++i) {
    forward(*first, c);
    EXPECT_EQ(bytes_of(c.out), bits) << "run " << i + 2;
  }
  for (const MegakernelConfig& cfg :
       {megakernel_config(1, 128, 128), megakernel_config(8, 512, 1024), megakernel_config(64, 1024, 8192),
        megakernel_config(std::min(100, cuda::context_sm_count() - 4), 128, 256)}) {
    auto mk = make_moe_layer(s, nullptr, gpu_test::megakernel_options(cfg, T));
    forward(*mk, c);
    EXPECT_EQ(bytes_of(c.out), bits) << "comm " << cfg.num_comm_sms << " minibatch " << cfg.minibatch_size
                                     << " macrobatch " << cfg.macrobatch_size;
  }
}

TEST(Megakernel, GraphCaptureReplays) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  const uint64_t seed = fresh_seed();
  GpuCase c(s, 700, seed);
  route_and_upload(c, U, seed + 1);
  auto mk = make_moe_layer(s, nullptr, gpu_test::megakernel_options(kRingReuse, 700));
  forward(*mk, c);
  const auto eager = bytes_of(c.out);
  c.poison();
  gpu_test::replay_in_graph([&](Stream s) { mk->forward(c.inputs(), c.weights(), c.out_view(), s); }, 3,
                            [&](int i) {
                              mk->check_errors();
                              EXPECT_EQ(bytes_of(c.out), eager) << "replay " << i;
                              c.poison();
                            });
}

// Every task appears once in the timeline, with sane stamps, and compute overlaps communication.
TEST(Megakernel, TimelineHoldsEveryTask) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  const uint64_t seed = fresh_seed();
  GpuCase c(s, 2000, seed);
  route_and_upload(c, U, seed + 1);
  auto mk = make_moe_layer(s, nullptr, gpu_test::megakernel_options(megakernel_config(8, 512, 2048), 2000));
  mk->megakernel()->record_timeline(true);
  forward(*mk, c);
  const auto spans = mk->megakernel()->timeline();
  std::map<std::string, int> kinds;
  for (const auto& t : spans) {
    kinds[t.kind]++;
    EXPECT_LE(t.start_ns, t.end_ns);
    EXPECT_GE(t.cta, 0);
  }
  for (const char* k : {"shared_gate_up", "shared_down", "dispatch", "gate_up", "down", "combine"})
    EXPECT_GT(kinds[k], 0) << k;
  EXPECT_EQ(kinds["dispatch"], kinds["combine"]);
  // Roles go by arrival order: the first 8 CTAs to start communicate, the others compute.
  for (const auto& t : spans) {
    const bool comm = std::string(t.kind) == "dispatch" || std::string(t.kind) == "combine";
    EXPECT_EQ(t.cta < 8, comm) << t.kind << " on CTA " << t.cta;
  }
}

// The megakernel's compute role alone over rows grouped beforehand (no communication CTA)
// against the fp64 CPU reference: with k = 1 and unit route weights each token's output is its
// expert row's y. Then the same bits again.
TEST(MegakernelCore, MatchesReferenceOnGroupedRows) {
  const MoeShape s = shape(512, 384, 8, 1);
  const int64_t T = 300;
  const uint64_t seed = fresh_seed();
  GpuCase c(s, T, seed);
  std::fill(c.ref.topk_weights.begin(), c.ref.topk_weights.end(), 1.0);
  route_and_upload(c, Z, seed + 1);
  const fixtures::GroupedSchedule sched(c.ids.as<int32_t>(), c.w.as<float>(), s, T, 128, nullptr);
  cuda::MegakernelCore core(s, megakernel_config(1, 256, 256), T);
  const int64_t rows = core.rows(), H = s.hidden, I = s.intermediate;
  ASSERT_GE(rows, sched.rows);
  gpu_test::DeviceTensor grouped(rows * H * 2), gate(rows * I * 2), up(gate.bytes()), hidden(gate.bytes()),
      y(rows * H * 2);
  MOKA_CUDA_CHECK(cudaMemset(grouped.data(), 0, grouped.bytes()));
  cuda::gather_rows(c.x.as<cuda::bf16>(), grouped.as<cuda::bf16>(), sched.row_of_slot.as<int32_t>(), T, 1, H, nullptr);
  const cuda::GroupedExpertRows g{grouped.as<cuda::bf16>(), sched.offsets.as<int32_t>(), gate.as<cuda::bf16>(),
                                  up.as<cuda::bf16>(),      hidden.as<cuda::bf16>(),     y.as<cuda::bf16>()};
  auto run = [&] {
    MOKA_CUDA_CHECK(cudaMemset(y.data(), 0xFF, y.bytes()));
    core.run(g, c.wg.as<cuda::bf16>(), c.wu.as<cuda::bf16>(), c.wd.as<cuda::bf16>(), nullptr);
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    core.check_errors();
    return bytes_of(y);
  };
  const auto bits = run();
  std::vector<int32_t> row_of_token(T);
  MOKA_CUDA_CHECK(cudaMemcpy(row_of_token.data(), sched.row_of_slot.data(), T * 4, cudaMemcpyDeviceToHost));
  std::vector<double> got(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      __nv_bfloat16 v;
      std::memcpy(&v, bits.data() + (row_of_token[t] * H + h) * 2, 2);
      got[t * H + h] = __bfloat162float(v);
    }
  auto cpu = make_moe_layer(s, Backend::cpu);
  cpu->forward(c.ref.inputs(), c.ref.weights(), c.ref.out_view(), Stream{});
  EXPECT_LE(cli::max_rel_error(got, c.ref.out), 2e-2);
  EXPECT_EQ(run(), bits);
}

TEST(Megakernel, BadExpertIdIsReportedNamingTheEntry) {
  const MoeShape s = shape(256, 128, 16, 4);
  GpuCase c(s, 10, 1);
  c.ref.topk_ids = core::sample_topk_ids({U, 0.5, 2}, 10, 4, 16);
  c.ref.topk_ids[3 * 4 + 2] = 99;
  c.upload();
  auto mk = make_moe_layer(s, nullptr, gpu_test::megakernel_options(kDefault, 10));
  mk->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(gpu_test::all_nan(c.out.data(), c.out.bytes())) << "the failed call's output";
  try {
    mk->check_errors();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[3, 2]"), std::string::npos) << e.what();
  }
}

// A wait bounded by 1 ns must time out (gate|up tiles wait for the dispatch of their rows) and
// be reported with its stage and counter instead of hanging or trapping.
TEST(Megakernel, SpinTimeoutIsReportedNotHung) {
  const MoeShape s = shape(1024, 512, 32, 4);
  GpuCase c(s, 2000, 3);
  route_and_upload(c, U, 3 + 1);
  MegakernelConfig cfg = megakernel_config(1, 128, 256);
  cfg.spin_timeout_seconds = 1e-9;
  auto mk = make_moe_layer(s, nullptr, gpu_test::megakernel_options(cfg, 2000));
  mk->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  try {
    mk->check_errors();
    FAIL() << "no timeout reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("timeout: ", 1), std::string::npos) << "the code named twice: " << e.what();
  }
  // The next call runs normally.
  MegakernelConfig ok = megakernel_config(8, 512, 1024);
  auto again = make_moe_layer(s, nullptr, gpu_test::megakernel_options(ok, 2000));
  forward(*again, c);
}

// A failed call's TMA loads must have landed before its CTAs exit: a load still in flight would
// write into the shared memory of the next kernel on that SM. Failed calls (1 ns bound) and good
// ones alternate on one stream with no synchronization between them; every good call has the
// bits of a good call run alone.
TEST(Megakernel, FailedCallLeavesNoLoadsInFlight) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  GpuCase c(s, 2000, 7);
  route_and_upload(c, U, 7 + 1);
  MegakernelConfig impatient = megakernel_config(1, 128, 256);
  impatient.spin_timeout_seconds = 1e-9;
  auto failing = make_moe_layer(s, nullptr, gpu_test::megakernel_options(impatient, 2000));
  auto good = make_moe_layer(s, nullptr, gpu_test::megakernel_options(megakernel_config(8, 512, 1024), 2000));
  forward(*good, c);
  const auto bits = bytes_of(c.out);
  DeviceTensor scratch(c.out.bytes());
  const TensorView scratch_view = [&] {
    TensorView v = c.out_view();
    v.data = scratch.data();
    return v;
  }();
  for (int round = 0; round < 4; ++round) {
    c.poison();
    failing->forward(c.inputs(), c.weights(), scratch_view, Stream{});
    good->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    good->check_errors();
    EXPECT_THROW(failing->check_errors(), Error) << "round " << round;
    EXPECT_EQ(bytes_of(c.out), bits) << "round " << round;
  }
}

// The persistent grids are sized to the SMs the context owns: an MPS client with an
// active-thread limit, an SM-count execution affinity or a green context owns part of the GPU,
// and a cooperative launch of the whole GPU's count fails there. `MODE=mps scripts/gpu.sh check`
// runs the megakernel suites in an MPS client at half the threads with MOKA_TEST_GPU_SMS set to
// the whole GPU's count.
TEST(MegakernelGrid, SizedToTheSmsTheContextOwns) {
  int device_sms = 0;
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, gpu_test::current_device()));
  const int owned = cuda::context_sm_count();
  std::printf("[ grid     ] the device attribute's SMs %d, the context's %d\n", device_sms, owned);
  EXPECT_GE(owned, 1);
  EXPECT_LE(owned, device_sms);
  if (const char* whole = std::getenv("MOKA_TEST_GPU_SMS")) {
    EXPECT_LT(owned, std::atoi(whole));
  }
}

TEST(Megakernel, RejectsBadConfigAndTooManyTokens) {
  const MoeShape s = shape(256, 128, 16, 4);
  MegakernelConfig cfg = kDefault;
  cfg.tile_n = 64;
  EXPECT_THROW(make_moe_layer(s, nullptr, gpu_test::megakernel_options(cfg, 10)), Error);
  cfg = kDefault;
  cfg.num_comm_sms = 100000;
  EXPECT_THROW(make_moe_layer(s, nullptr, gpu_test::megakernel_options(cfg, 10)), Error);
  GpuCase c(s, 20, 4);
  route_and_upload(c, U, 4 + 1);
  auto mk = make_moe_layer(s, nullptr, gpu_test::megakernel_options(kDefault, 10));
  try {
    mk->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
    FAIL() << "20 tokens accepted by a layer built for 10";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most 10"), std::string::npos) << e.what();
  }
}

}  // namespace

namespace {

// A resident context's g and u by slot, unpacked into grouped rows, against the host's copy:
// random slots for the grouped rows of a few experts (padding rows -1; some slots routed to no
// row; grouped rows past the schedule's), a sentinel in everything that must stay unwritten;
// widths of one 16-byte vector, of several with a partial last warp step, and of more than a
// warp's. Unpacking zeroes the schedule's padding rows (the dgd tiles read them) and nothing past
// them.
TEST(MegakernelSavedRows, UnpackMovesTheRoutedRowsOnly) {
  std::mt19937_64 rng(fresh_seed());
  const uint16_t sentinel = 0x1234;
  auto value = [&] { return uint16_t(0x4000 | rng() % 0x3f00); };  // finite, never the sentinel or 0
  for (const int64_t width : {int64_t(8), int64_t(264), int64_t(2888)}) {
    SCOPED_TRACE("width " + std::to_string(width));
    const int64_t slots = 320, capacity = 768;
    std::vector<int32_t> slot_of_row(capacity, -1), order(slots);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int64_t counts[] = {0, 1, 127, 128, 45};  // experts' rows, each segment padded to 128
    int32_t end = 0;
    int64_t next = 0;
    for (int64_t n : counts) {
      for (int64_t r = 0; r < n; ++r) slot_of_row[end + r] = order[next++];
      end += int32_t((n + 127) / 128 * 128);
    }
    ASSERT_LT(end, capacity);
    std::vector<uint16_t> by_slot(slots * width);
    for (uint16_t& v : by_slot) v = value();
    cuda::DeviceArray<int32_t> d_slots(slot_of_row.size()), d_end(1);
    cuda::DeviceArray<uint16_t> d_grouped(capacity * width), d_by_slot(by_slot.size());
    d_slots.upload(slot_of_row, nullptr);
    d_end.upload(&end, 1, nullptr);
    d_grouped.upload(std::vector<uint16_t>(capacity * width, sentinel), nullptr);
    d_by_slot.upload(by_slot, nullptr);
    cuda::SavedRows rows;
    rows.slot_of_row = d_slots.data();
    rows.schedule_rows = d_end.data();
    rows.grouped_rows = capacity;
    rows.slots = slots;
    rows.width = width;
    rows.grouped = reinterpret_cast<cuda::bf16*>(d_grouped.data());
    rows.by_slot = reinterpret_cast<cuda::bf16*>(d_by_slot.data());
    cuda::unpack_saved_rows(rows, nullptr);
    const std::vector<uint16_t> unpacked = d_grouped.download(nullptr);
    EXPECT_TRUE(d_by_slot.download(nullptr) == by_slot) << "the rows by slot changed";
    for (int64_t r = 0; r < capacity; ++r) {
      const bool routed = slot_of_row[r] >= 0, scheduled = r < end;
      std::vector<uint16_t> expected(width, scheduled ? 0 : sentinel);
      if (routed) std::copy_n(by_slot.begin() + slot_of_row[r] * width, width, expected.begin());
      EXPECT_TRUE(std::equal(expected.begin(), expected.end(), unpacked.begin() + r * width))
          << "grouped row " << r
          << (routed      ? ": not its slot's row"
              : scheduled ? ": a padding row not zeroed"
                          : ": a row past the schedule written");
    }
  }
  cuda::SavedRows ragged;
  ragged.width = 12;
  EXPECT_THROW(cuda::unpack_saved_rows(ragged, nullptr), Error);
}

// The megakernel path of MoeLayer, forward and backward, against the single-GPU path on the
// same inputs (and the same routed rows per expert). At EP = 1 the megakernel path's forward has
// the staged path's bits and its backward runs the backward megakernel (other summation orders:
// within bf16 tolerance of the staged gradients),
// with the ring holding every row (resident context) and with a smaller ring (replay). Each
// context owns what its backward reads: two forwards in flight, their backwards in reverse order
// (the first on another stream), and consume_backward all give the one-at-a-time bits.
void check_megakernel_path(const MegakernelConfig& config, SaveMode save = SaveMode::gate_up,
                           const MoeShape& s = shape(1024, 512, 32, 4, 256), int64_t T = 700) {
  const uint64_t seed = fresh_seed();
  GpuCase c(s, T, seed);
  route_and_upload(c, Z, seed + 1);
  auto run = [&](MoeLayer& layer) {
    c.poison();
    auto ctx = layer.forward(c.inputs(), c.weights(), c.out_view(), Stream{});
    layer.backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    layer.check_errors();
    return std::pair{c.download(), ctx->local_expert_rows()};
  };
  LayerOptions single;
  single.path = LayerPath::single_gpu;
  auto staged = make_moe_layer(s, nullptr, single);
  ASSERT_EQ(staged->megakernel(), nullptr);
  const auto want = run(*staged);
  staged.reset();
  LayerOptions options = gpu_test::megakernel_options(config, T);
  options.save = save;
  auto mk = make_moe_layer(s, nullptr, options);
  ASSERT_NE(mk->megakernel(), nullptr);
  for (int i = 0; i < 2; ++i) {  // twice: the second backward runs over a used workspace
    const auto [got, rows] = run(*mk);
    EXPECT_TRUE(got.out == want.first.out) << "run " << i << ": out differs from the single-GPU path's";
    const auto g = got.outputs(), r = want.first.outputs();
    for (size_t t = 1; t < g.size(); ++t) {
      if (r[t]->empty()) continue;  // no shared expert
      EXPECT_LE(cli::max_rel_error(*g[t], *r[t]), 2e-2) << "run " << i << ", gradient " << t;
    }
    EXPECT_EQ(rows, want.second) << "run " << i;
  }
  const auto one_at_a_time = c.output_bytes();

  // Two forwards in flight (the second on other tokens, routes and a poisoned output), backwards
  // in reverse order: the first context's backward, on another stream, gives its own bits.
  GpuCase other(s, T - 77, seed + 2);
  route_and_upload(other, U, seed + 3);
  c.poison();
  other.poison();
  auto first = mk->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  auto second = mk->forward(other.inputs(), other.weights(), other.out_view(), Stream{});
  mk->backward(*second, other.d_out_view(), other.weights(), other.gradients(), Stream{});
  cudaStream_t side = nullptr;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  mk->backward(*first, c.d_out_view(), c.weights(), c.gradients(), Stream{side});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  mk->check_errors();
  EXPECT_TRUE(c.output_bytes() == one_at_a_time) << "the first of two forwards in flight: not its one-at-a-time bits";
  EXPECT_EQ(first->local_expert_rows(), want.second) << "the first context's rows per expert";
  // Resident: the schedule, the routed rows' g and u (T*k rows by slot where the grouped rows'
  // padding exceeds a tenth of them, else the grouped rows) and the shared expert's; replay: the
  // schedule only.
  const core::MegakernelPlan plan = core::build_megakernel_plan(config, {1, T, s.top_k, s.hidden, s.intermediate,
                                                                         s.shared_intermediate, s.num_experts});
  const int64_t slots = T * s.top_k, schedule_bytes = (2 * s.num_experts + 1 + plan.capacity_rows) * 4;
  const int64_t rows = core::saves_rows_by_slot(plan.ring_rows, slots) ? slots : plan.ring_rows;
  const int64_t gate_up_bytes = 2 * rows * s.intermediate * 2 + 2 * T * s.shared_intermediate * 2;
  if (mk->megakernel()->backward_is_resident()) EXPECT_EQ(first->saved_bytes(), schedule_bytes + gate_up_bytes);
  else EXPECT_EQ(first->saved_bytes(), schedule_bytes);

  // consume_backward: the same bits (resident: dg and du over the context's g and u).
  c.poison();
  auto consumed = mk->forward(c.inputs(), c.weights(), c.out_view(), Stream{side});
  mk->consume_backward(std::move(consumed), c.d_out_view(), c.weights(), c.gradients(), Stream{side});
  MOKA_CUDA_CHECK(cudaStreamSynchronize(side));
  mk->check_errors();
  EXPECT_TRUE(c.output_bytes() == one_at_a_time) << "consume_backward: not backward's bits";
  // The contexts' memory goes back on the stream of its last use: before that stream goes.
  first.reset();
  second.reset();
  MOKA_CUDA_CHECK(cudaStreamDestroy(side));
}

// A failure found on the device surfaces at the layer's next call, forward or backward (a
// training loop that never calls check_errors() stops there), and the failed call's outputs are
// NaN, so nothing downstream takes them for numbers. A 1 ns bound makes every call fail.
TEST(MegakernelPath, FailuresSurfaceAtTheNextCallWithNaNOutputs) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  GpuCase c(s, 700, 11);
  route_and_upload(c, U, 11 + 1);
  MegakernelConfig impatient = megakernel_config(4, 512, 1 << 20);
  impatient.spin_timeout_seconds = 1e-9;
  auto layer = make_moe_layer(s, nullptr, gpu_test::megakernel_options(impatient, 700));
  auto zero_outputs = [&] {
    for (DeviceTensor* t : c.device_outputs()) MOKA_CUDA_CHECK(cudaMemset(t->data(), 0, t->bytes()));
  };
  auto expect_raises = [&](auto&& call, const char* direction, const char* who) {
    try {
      call();
      ADD_FAILURE() << "the " << who << "'s failure was not raised by the next " << direction;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what();
      if (std::string(who) == "backward") {
        EXPECT_NE(std::string(e.what()).find("megakernel backward"), std::string::npos) << e.what();
      }
    }
  };
  zero_outputs();
  auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(gpu_test::all_nan(c.out.data(), c.out.bytes())) << "a failed forward's output";
  expect_raises([&] { layer->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{}); }, "backward",
                "forward");
  // Raised once: this backward runs (and fails in turn).
  layer->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  for (DeviceTensor* t : {&c.d_x, &c.d_w, &c.dwg, &c.dwu, &c.dwd, &c.dwsg, &c.dwsu, &c.dwsd})
    EXPECT_TRUE(gpu_test::all_nan(t->data(), t->bytes())) << "a failed backward's gradients";
  expect_raises([&] { layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{}); }, "forward", "backward");
}

// A gradient view off a 16-byte boundary (the megakernel stores 8 and 16 bytes at a time) is an
// error naming it, before the call touches anything: the same context then runs a backward.
TEST(MegakernelPath, MisalignedGradientsAreAnErrorNamingThem) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  const uint64_t seed = fresh_seed();
  GpuCase c(s, 300, seed);
  route_and_upload(c, U, seed + 1);
  auto layer = make_moe_layer(s, nullptr, gpu_test::megakernel_options(megakernel_config(4, 512, 1 << 20), 300));
  auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  DeviceTensor spare(c.dwu.bytes() + 16);
  MoeGradients g = c.gradients();
  g.d_w_up.data = static_cast<char*>(spare.data()) + 2;
  try {
    layer->backward(*ctx, c.d_out_view(), c.weights(), g, Stream{});
    ADD_FAILURE() << "a misaligned d_w_up was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("d_w_up starts 2 bytes"), std::string::npos) << e.what();
  }
  c.poison();
  layer->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  layer->check_errors();
  EXPECT_FALSE(gpu_test::all_nan(c.dwu.data(), c.dwu.bytes()));
}

TEST(MegakernelPath, ResidentBackwardMatchesTheStagedPathAndKeepsContextsApart) {
  check_megakernel_path(megakernel_config(4, 512, 1 << 20));
}
// Two experts for 3000 tokens: the grouped rows' padding is under a tenth of the rows, so the
// context keeps the kernel's grouped rows (not by slot).
TEST(MegakernelPath, ResidentGroupedContextMatchesTheStagedPathAndKeepsContextsApart) {
  const MoeShape few_experts = shape(1024, 512, 2, 2, 256);
  const MegakernelConfig config = megakernel_config(4, 512, 1 << 20);
  const core::MegakernelPlan plan = core::build_megakernel_plan(config, {1, 3000, 2, 1024, 512, 256, 2});
  ASSERT_FALSE(core::saves_rows_by_slot(plan.ring_rows, 3000 * 2)) << plan.ring_rows << " grouped rows";
  check_megakernel_path(config, SaveMode::gate_up, few_experts, 3000);
}
TEST(MegakernelPath, ReplayBackwardMatchesTheStagedPathAndKeepsContextsApart) { check_megakernel_path(kRingReuse); }
TEST(MegakernelPath, SaveNoneReplaysAWholeRingAndKeepsContextsApart) {
  check_megakernel_path(megakernel_config(4, 512, 1 << 20), SaveMode::none);
}

// Forward and backward through both megakernels captured in one CUDA graph (EP = 1, replay
// mode: the ring is smaller than the rows): every replay gives the eager call's bits.
TEST(MegakernelPath, ForwardAndBackwardReplayInOneGraph) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  const uint64_t seed = fresh_seed();
  GpuCase c(s, 700, seed);
  route_and_upload(c, U, seed + 1);
  auto mk = make_moe_layer(s, nullptr, gpu_test::megakernel_options(kRingReuse, 700));
  auto step = [&](Stream stream) {
    auto ctx = mk->forward(c.inputs(), c.weights(), c.out_view(), stream);
    mk->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), stream);
  };
  step(Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  mk->check_errors();
  const auto eager = c.output_bytes();
  c.poison();
  gpu_test::replay_in_graph(step, 3, [&](int i) {
    mk->check_errors();
    EXPECT_TRUE(c.output_bytes() == eager) << "replay " << i;
    c.poison();
  });
}

// LayerPath::automatic takes the megakernel only where it applies and was measured faster: never
// on one GPU (measured slower there); an explicit megakernel path runs on one GPU.
TEST(MegakernelPath, AutomaticKeepsOneGpuOnTheSingleGpuPath) {
  const MoeShape narrow = shape(1024, 512, 32, 4, 256);
  LayerOptions o;
  o.max_tokens = 64;
  EXPECT_EQ(make_moe_layer(narrow, nullptr, o)->megakernel(), nullptr) << "one GPU: the single-GPU path";
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  EXPECT_EQ(cuda::choose_path(narrow, 1, device, o), LayerPath::single_gpu);
  int devices = 0;
  MOKA_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    EXPECT_EQ(cuda::choose_path(narrow, 2, device, o), LayerPath::all_to_all) << "two ranks, one visible GPU";
  }
  o.path = LayerPath::megakernel;
  EXPECT_NE(make_moe_layer(narrow, nullptr, o)->megakernel(), nullptr);
  o.tile_rows = 64;
  EXPECT_THROW(make_moe_layer(narrow, nullptr, o), Error) << "tile_rows other than its 128";
  o.path = LayerPath::all_to_all;
  EXPECT_THROW(make_moe_layer(narrow, nullptr, o), Error) << "all_to_all on one GPU";
}

}  // namespace
