// `moka bench --backend cuda`, layer mode: each path's forward+backward step on one GPU
// (single-GPU and megakernel paths) or over the worker processes (all-to-all and megakernel
// paths), the two paths timed alternately on the same tensors, each set against the case's floor,
// its layer's peak device memory and PyTorch's results.
#include "bench_cuda.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "core/atomic_file.hpp"
#include "core/routing_gen.hpp"
#include "gpu/bench_memory.hpp"
#include "gpu/gpu_timing.hpp"
#include "moka/device_group.hpp"
#include "moka/moka.hpp"

namespace moka::cli {

namespace {

// One forward+backward step of a layer: the milliseconds of its forward and of its backward
// (CUDA events around each half; the step is their sum). Synchronizes the stream.
struct StepTime {
  double fwd_ms = 0, bwd_ms = 0;
};
StepTime time_step(MoeLayer& layer, const LayerTensors& t, cudaStream_t s) {
  struct Events {
    cudaEvent_t e[3] = {};
    Events() {
      for (auto& event : e) BENCH_CHECK(cudaEventCreate(&event));
    }
    ~Events() {
      for (auto event : e) cudaEventDestroy(event);
    }
  } ev;
  BENCH_CHECK(cudaEventRecord(ev.e[0], s));
  auto ctx = layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
  BENCH_CHECK(cudaEventRecord(ev.e[1], s));
  layer.consume_backward(std::move(ctx), t.d_out_view(), t.weights(), t.gradients(), Stream{s});
  BENCH_CHECK(cudaEventRecord(ev.e[2], s));
  BENCH_CHECK(cudaEventSynchronize(ev.e[2]));
  float fwd = 0, bwd = 0;
  BENCH_CHECK(cudaEventElapsedTime(&fwd, ev.e[0], ev.e[1]));
  BENCH_CHECK(cudaEventElapsedTime(&bwd, ev.e[1], ev.e[2]));
  return {fwd, bwd};
}

// Medians of one path's steps.
struct PathSteps {
  double fwd_ms = 0, bwd_ms = 0, fwdbwd_ms = 0;
};
// Two paths' steps from runs that alternated them (a, then b, --iters times after --warmup
// pairs): each path's medians and the medians of the per-run ratios a / b (b's speedup over a).
// With workers, every run counts at its slowest rank: the step takes that long for the group.
struct PairedSteps {
  PathSteps a, b;
  double fwd_speedup = 0, bwd_speedup = 0, fwdbwd_speedup = 0;
};
PairedSteps time_paired_steps(MoeLayer& a, MoeLayer& b, const LayerTensors& t, const CudaBenchOptions& o,
                              ProcessGroup* workers, cudaStream_t s) {
  const auto [runs_a, runs_b] =
      alternate([&] { return time_step(a, t, s); }, [&] { return time_step(b, t, s); }, o.warmup, o.iters);
  a.check_errors();
  b.check_errors();
  struct Series {
    std::vector<double> fwd, bwd, step;
  };
  auto series = [&](const std::vector<StepTime>& runs) {
    Series x;
    for (const StepTime& r : runs) {
      x.fwd.push_back(r.fwd_ms);
      x.bwd.push_back(r.bwd_ms);
      x.step.push_back(r.fwd_ms + r.bwd_ms);
    }
    if (workers)
      x = {max_over_ranks(*workers, x.fwd), max_over_ranks(*workers, x.bwd), max_over_ranks(*workers, x.step)};
    return x;
  };
  const Series sa = series(runs_a), sb = series(runs_b);
  PairedSteps p;
  p.a = {median(sa.fwd), median(sa.bwd), median(sa.step)};
  p.b = {median(sb.fwd), median(sb.bwd), median(sb.step)};
  p.fwd_speedup = median_ratio(sb.fwd, sa.fwd);
  p.bwd_speedup = median_ratio(sb.bwd, sa.bwd);
  p.fwdbwd_speedup = median_ratio(sb.step, sa.step);
  return p;
}

// Per-stage medians of `iters` steps of `layer` (MoeLayer::stage_times): {"forward": {stage: ms},
// "backward": {...}} in the order the path runs them; with workers, each stage at its slowest rank.
nlohmann::ordered_json stage_breakdown(MoeLayer& layer, const LayerTensors& t, int iters, ProcessGroup* workers,
                                       cudaStream_t s) {
  layer.record_stage_times(true);
  std::vector<std::pair<std::string, std::string>> order;  // (direction, stage) as first seen
  std::map<std::pair<std::string, std::string>, std::vector<double>> samples;
  for (int i = 0; i < iters; ++i) {
    time_step(layer, t, s);  // synchronizes
    for (const StageTime& st : layer.stage_times()) {
      auto& v = samples[{st.direction, st.stage}];
      if (v.empty()) order.emplace_back(st.direction, st.stage);
      v.push_back(st.ms);
    }
  }
  layer.record_stage_times(false);
  layer.check_errors();
  auto j = nlohmann::ordered_json::object();
  for (const auto& key : order) {
    std::vector<double>& v = samples[key];
    j[key.first][key.second] = workers ? median(max_over_ranks(*workers, v)) : median(v);
  }
  return j;
}

// What one step of a path writes that every path must reproduce: out, d_x and d_w_down.
struct StepOutputs {
  std::vector<__nv_bfloat16> out, d_x, d_w_down;
};
StepOutputs step_outputs(MoeLayer& layer, const LayerTensors& t, cudaStream_t s) {
  {
    auto c = layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
    layer.backward(*c, t.d_out_view(), t.weights(), t.gradients(), Stream{s});
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  layer.check_errors();
  return {read_bf16(t.out), read_bf16(t.d_x), read_bf16(t.dwd)};
}
// The largest relative difference of the three outputs from the reference's.
double max_rel_diff(const StepOutputs& got, const StepOutputs& want) {
  return std::max({rel_diff(got.out, want.out), rel_diff(got.d_x, want.d_x), rel_diff(got.d_w_down, want.d_w_down)});
}
bool same_bits(const StepOutputs& a, const StepOutputs& b) {
  auto same = [](const std::vector<__nv_bfloat16>& x, const std::vector<__nv_bfloat16>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  return same(a.out, b.out) && same(a.d_x, b.d_x) && same(a.d_w_down, b.d_w_down);
}

// The routed rows a megakernel layer's tables hold, rounded up to whole minibatches: the
// capacity include/moka/megakernel.hpp states (capacity_multiplier's comment).
int64_t megakernel_capacity_rows(const MegakernelConfig& c, const MoeShape& sh, int ranks, int64_t tokens) {
  const int64_t shares = std::max<int64_t>(2, int64_t(std::ceil(ranks * c.capacity_multiplier)));
  const int64_t rows =
      tokens * sh.top_k * std::min<int64_t>(ranks, shares) + sh.num_experts / ranks * (c.tile_rows - 1);
  return (rows + c.minibatch_size - 1) / c.minibatch_size * c.minibatch_size;
}

// The megakernel knobs of a case for --context: "resident" grows the ring (macrobatch) to hold
// every routed row the case can have, "replay" requires a ring that does not, "auto" keeps them.
MegakernelConfig case_megakernel_config(const CudaBenchOptions& o, const MoeShape& sh, int ranks, int64_t tokens) {
  MegakernelConfig c = o.megakernel;
  if (o.context == "auto") return c;
  const int64_t capacity = megakernel_capacity_rows(c, sh, ranks, tokens);
  if (o.context == "resident") {
    c.macrobatch_size = capacity;
    return c;
  }
  require(c.macrobatch_size < capacity, ErrorCode::invalid_argument,
          "--context replay needs a ring that does not hold every routed row: --macrobatch " +
              std::to_string(c.macrobatch_size) + " holds all " + std::to_string(capacity) +
              " rows of this case; give one below that");
  return c;
}

// One JSON line per task span, built whole and written atomically: a failed write leaves the
// previous timeline (or none).
void write_timeline(const std::string& path, const std::string& shape, int64_t tokens, int ep,
                    const std::vector<MegakernelTaskSpan>& spans) {
  int64_t t0 = spans.empty() ? 0 : spans.front().start_ns;
  for (const auto& t : spans) t0 = std::min(t0, t.start_ns);
  std::string lines;
  for (const auto& t : spans)
    lines += nlohmann::json{{"shape", shape},
                            {"tokens_per_rank", tokens},
                            {"ep", ep},
                            {"cta", t.cta},
                            {"kind", t.kind},
                            {"step", t.step},
                            {"row_tile", t.row_tile},
                            {"start_us", (t.start_ns - t0) / 1e3},
                            {"end_us", (t.end_ns - t0) / 1e3}}
                 .dump() +
             "\n";
  core::write_file_atomically(path, lines);
}

// --timeline: one more megakernel forward with its task stamps on, written by rank 0.
void record_timeline(MoeLayer& mk, DeviceGroup* group, const NamedShape& ns, const LayerTensors& t,
                     const CudaBenchOptions& o, cudaStream_t s) {
  if (o.timeline.empty()) return;
  mk.megakernel()->record_timeline(true);
  mk.forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
  BENCH_CHECK(cudaStreamSynchronize(s));
  mk.check_errors();
  mk.megakernel()->record_timeline(false);
  if (!group || group->rank() == 0)
    write_timeline(o.timeline, ns.name, t.T, group ? group->size() : 1, mk.megakernel()->timeline());
}

// What run_paths measures of a case: the staged path's steps (`steps.a`) and the megakernel's
// (`steps.b`, its outputs' largest relative difference from the staged path's: `mk_diff`), and
// the peak memory of each path's layer.
struct CaseResults {
  PairedSteps steps;
  nlohmann::ordered_json staged_stages, mk_stages;  // --breakdown
  double mk_diff = 0;
  LayerMemory staged_memory, mk_memory;  // a stack of one, with the stack's peak of --depth
  int depth = 1;
  MegakernelConfig mk_config;
  bool mk_resident = false;  // the megakernel layer's backward context
};
// The two rows of a case, the staged path's (`staged`, its common fields and its own columns
// set) and the megakernel's, each with its step times, the case's floor, its layer's memory and
// torch's results.
std::vector<BenchRow> path_rows(BenchRow staged, const CaseResults& r, const LayerFloor& floor, double peak_tflops,
                                const MoeShape& sh, const TorchResult& torch) {
  BenchRow mk = staged;
  mk.path = "megakernel";
  mk.extra = nlohmann::ordered_json::object();
  auto fill = [&](BenchRow& row, const PathSteps& steps, const LayerMemory& memory) {
    row.fwd_ms = steps.fwd_ms;
    row.bwd_ms = steps.bwd_ms;
    row.fwdbwd_ms = steps.fwdbwd_ms;
    row.tflops = 3.0 * sh.forward_flops(row.tokens_per_rank) / (steps.fwdbwd_ms * 1e-3) / 1e12;
    row.peak_memory_bytes = memory.peak;
    set_floor(row, floor, peak_tflops);
    set_torch(row, torch);
    set_memory(row, memory, r.depth, torch);
    const auto& stages = &row == &staged ? r.staged_stages : r.mk_stages;
    if (!stages.is_null()) row.extra["stages"] = stages;
    row.extra["times"] = "medians of runs alternating the " + staged.path + " and megakernel paths" +
                         (row.ep > 1 ? ", each run at its slowest rank" : "");
  };
  fill(staged, r.steps.a, r.staged_memory);
  fill(mk, r.steps.b, r.mk_memory);
  mk.max_rel_error = r.mk_diff;
  auto& e = mk.extra;
  e["error_vs"] = staged.path;
  e["megakernel_config"] = megakernel_config_text(r.mk_config);
  e["context_mode"] = r.mk_resident ? "resident" : "replay";
  e["paired_path"] = staged.path;
  e["fwd_speedup_vs_paired"] = r.steps.fwd_speedup;
  e["bwd_speedup_vs_paired"] = r.steps.bwd_speedup;
  e["fwdbwd_speedup_vs_paired"] = r.steps.fwdbwd_speedup;
  if (torch.fwd_ms > 0) {
    e["torch_fwd_ms"] = torch.fwd_ms;
    e["fwd_speedup_vs_torch"] = torch.fwd_ms / r.steps.b.fwd_ms;
  }
  return {staged, mk};
}

// Checks the megakernel path against the staged path's outputs (`want`, from `staged` on `t`),
// times the two alternately on the same tensors, then frees both and measures each path's memory
// on a fresh layer (`make_staged` builds the staged path's layer again).
CaseResults run_paths(std::unique_ptr<MoeLayer> staged, const StepOutputs& want, const MakeLayer& make_staged,
                      DeviceGroup* group, ProcessGroup* workers, const NamedShape& ns, const LayerTensors& t,
                      const CudaBenchOptions& o, cudaStream_t s) {
  const MoeShape& sh = ns.shape;
  const int ranks = group ? group->size() : 1;
  CaseResults r;
  r.mk_config = case_megakernel_config(o, sh, ranks, t.T);
  auto make_mk = [&](DeviceAllocator* allocator) { return megakernel_layer(sh, group, r.mk_config, t.T, allocator); };
  auto mk = make_mk(nullptr);
  r.mk_resident = mk->megakernel()->backward_is_resident();
  r.mk_diff = max_rel_diff(step_outputs(*mk, t, s), want);
  r.steps = time_paired_steps(*staged, *mk, t, o, workers, s);
  if (o.breakdown) {
    r.staged_stages = stage_breakdown(*staged, t, o.iters, workers, s);
    r.mk_stages = stage_breakdown(*mk, t, o.iters, workers, s);
  }
  record_timeline(*mk, group, ns, t, o, s);
  staged.reset();
  mk.reset();
  r.depth = o.depth;
  r.staged_memory = path_memory(make_staged, t, o.depth, s);
  r.mk_memory = path_memory(make_mk, t, o.depth, s);
  if (workers) {
    r.mk_diff = max_over_ranks(*workers, r.mk_diff);
    for (LayerMemory* m : {&r.staged_memory, &r.mk_memory})
      for (int64_t* v : {&m->peak, &m->stack_peak, &m->saved_per_layer, &m->workspace_peak})
        *v = int64_t(max_over_ranks(*workers, double(*v)));
  }
  return r;
}

// SwiGLU in the gate GEMM's epilogue (LayerOptions::fused_swiglu) against the default unfused
// path (gate|up GEMM, then the activation pass), into the single-GPU row: the same bits (out,
// d_x, d_w_down), the forward timed alternately. (The comparisons that need the library's
// internals, the per-expert cuBLAS loop and the grouped GEMM alone, are the kernel lab's:
// bench/kernels/staged_baselines.)
void compare_fused_swiglu(MoeLayer& layer, const StepOutputs& moka, const LayerOptions& lo, const MoeShape& sh,
                          const LayerTensors& t, const CudaBenchOptions& o, cudaStream_t s, BenchRow& row) {
  LayerOptions fused_options = lo;
  fused_options.fused_swiglu = true;
  auto fused = make_moe_layer(sh, Backend::cuda, nullptr, fused_options);
  auto& e = row.extra;
  e["fused_swiglu_identical"] = same_bits(step_outputs(*fused, t, s), moka);
  const Paired fwd =
      time_paired([&] { fused->forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); },
                  [&] { layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); }, o.warmup, o.iters, s);
  e["fused_swiglu_fwd_ms"] = fwd.a_ms;
  e["unfused_swiglu_fwd_ms"] = fwd.b_ms;
  e["fused_swiglu_fwd_speedup"] = fwd.ratio;
}

}  // namespace

std::vector<BenchRow> run_cuda_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o) {
  const CaseStream stream("moka bench --backend cuda");
  const cudaStream_t s = stream.s;
  const MoeShape& sh = ns.shape;
  const double peak = dense_peak_tflops(s);
  LayerTensors t(sh, tokens);
  t.randomize_uniform(o.seed);
  LayerOptions lo{o.tile_rows, 0};
  lo.path = LayerPath::single_gpu;
  lo.save = o.save;
  auto make_layer = [&](DeviceAllocator* allocator) {
    LayerOptions with = lo;
    with.allocator = allocator;
    return make_moe_layer(sh, Backend::cuda, nullptr, with);
  };
  auto layer = make_layer(nullptr);
  const StepOutputs moka = step_outputs(*layer, t, s);
  BenchRow row = cuda_row(ns, "single-gpu", t.device, 1, tokens, o.iters);
  if (o.baselines) compare_fused_swiglu(*layer, moka, lo, sh, t, o, s, row);

  // The single-GPU and megakernel steps, alternately; with uniform routing every rank's rows are
  // T*k, and one GPU moves nothing over links.
  const CaseResults r = run_paths(std::move(layer), moka, make_layer, nullptr, nullptr, ns, t, o, s);
  const LayerFloor floor = layer_floor(sh, tokens, {tokens * sh.top_k}, 1, peak, std::nullopt);
  auto& e = row.extra;
  const TorchResult torch = torch_result(o.torch_results, ns.name, tokens, 1);
  if (torch.paired_runs > 0) {
    e["speedup_vs_torch_paired"] = torch.paired_ratio;
    e["paired_runs"] = torch.paired_runs;
    e["paired_moka_fwdbwd_ms"] = torch.paired_moka_ms;
  }
  return path_rows(row, r, floor, peak, sh, torch);
}

namespace {

// Median ms of one NCCL all-to-all-v moving `bytes_per_peer` to every other rank, and of a
// plain copy of the same bytes from the next rank's symmetric buffer (the NVLink ceiling).
struct LinkTiming {
  double all_to_all_ms = 0, peer_copy_ms = 0;
  double bytes_per_rank = 0;  // sent to other ranks
};

LinkTiming time_links(DeviceGroup& g, size_t bytes_per_peer, const CudaBenchOptions& o, cudaStream_t s) {
  const int R = g.size();
  LinkTiming t;
  t.bytes_per_rank = double(bytes_per_peer) * (R - 1);
  DeviceBuffer send(bytes_per_peer * R), recv(bytes_per_peer * R);
  std::vector<size_t> counts(R, bytes_per_peer), offsets(R);
  for (int p = 0; p < R; ++p) offsets[p] = p * bytes_per_peer;
  t.all_to_all_ms = time_ms(
      [&] {
        g.all_to_all_v(send.data(), counts.data(), offsets.data(), recv.data(), counts.data(), offsets.data(), s);
      },
      o.warmup, o.iters, s);
  const SymmetricBuffer& peer = g.allocate_symmetric(bytes_per_peer * (R - 1));
  const int next = (g.rank() + 1) % R;
  g.device_barrier(s, 30.0);
  t.peer_copy_ms = time_ms(
      [&] {
        BENCH_CHECK(
            cudaMemcpyAsync(recv.data(), peer.peers[next], bytes_per_peer * (R - 1), cudaMemcpyDeviceToDevice, s));
      },
      o.warmup, o.iters, s);
  g.device_barrier(s, 30.0);
  BENCH_CHECK(cudaStreamSynchronize(s));
  g.check_device_errors();
  return t;
}

// This rank's top-k ids for an expert-parallel case (o.routing; see CudaBenchOptions).
std::vector<int32_t> ep_routing(const CudaBenchOptions& o, const MoeShape& sh, int64_t tokens, int rank, int ranks) {
  const auto stream = static_cast<uint64_t>(rank);
  if (o.routing == "one-rank")
    return core::sample_topk_ids({core::RoutingKind::uniform, 0, o.seed}, tokens, sh.top_k, sh.num_experts / ranks,
                                 stream);
  const auto kind = o.routing == "zipf" ? core::RoutingKind::zipf : core::parse_routing_kind(o.routing);
  return core::sample_topk_ids({kind, o.gini, o.seed}, tokens, sh.top_k, sh.num_experts, stream);
}

// routes[s * R + r]: routes from rank s's tokens to the experts rank r hosts, over all workers.
std::vector<int64_t> route_matrix(ProcessGroup& workers, const std::vector<int32_t>& ids, int64_t experts_per_rank) {
  const int R = workers.size();
  const std::vector<int64_t> mine = routes_per_rank(ids, experts_per_rank, R);
  std::vector<int64_t> all(size_t(R) * R);
  workers.all_gather(mine.data(), all.data(), R * sizeof(int64_t));
  return all;
}

}  // namespace

void select_worker_device(int local_rank) { BENCH_CHECK(cudaSetDevice(local_rank)); }

std::vector<BenchRow> run_cuda_ep_case(ProcessGroup& workers, const NamedShape& ns, int64_t tokens,
                                       const CudaBenchOptions& o) {
  const MoeShape& sh = ns.shape;
  const int R = workers.size();
  cudaStream_t s;
  BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  LayerTensors t(sh, tokens, R);
  const std::vector<int32_t> ids = ep_routing(o, sh, tokens, workers.rank(), R);
  t.randomize(o.seed * 1000 + workers.rank(), ids);
  const std::vector<int64_t> routes = route_matrix(workers, ids, sh.num_experts / R);
  if (!o.dump_routing.empty()) {
    std::vector<int32_t> all(ids.size() * R);
    workers.all_gather(ids.data(), all.data(), ids.size() * sizeof(int32_t));
    std::vector<std::vector<int32_t>> per_rank;
    for (int r = 0; r < R; ++r) per_rank.emplace_back(all.begin() + r * ids.size(), all.begin() + (r + 1) * ids.size());
    if (workers.rank() == 0) dump_routing(o.dump_routing, ns, tokens, R, per_rank);
  }
  auto group = make_nccl_group(workers, t.device);
  LayerOptions all_to_all{o.tile_rows, 0};
  all_to_all.path = LayerPath::all_to_all;
  all_to_all.save = o.save;
  auto make_layer = [&](DeviceAllocator* allocator) {
    LayerOptions with = all_to_all;
    with.allocator = allocator;
    return make_moe_layer(sh, group.get(), with);
  };
  auto layer = make_layer(nullptr);
  const StepOutputs want = step_outputs(*layer, t, s);
  const CaseResults r = run_paths(std::move(layer), want, make_layer, group.get(), &workers, ns, t, o, s);
  // Uniform routing sends about T*k/R rows to each rank: time that much through NCCL and
  // through a plain peer copy.
  const size_t rows_per_peer = static_cast<size_t>(tokens * sh.top_k / R);
  const LinkTiming link = time_links(*group, rows_per_peer * sh.hidden * 2, o, s);
  const double peak = dense_peak_tflops(s);
  group.reset();
  BENCH_CHECK(cudaStreamDestroy(s));
  const double a2a = max_over_ranks(workers, link.all_to_all_ms), copy = max_over_ranks(workers, link.peer_copy_ms);
  if (workers.rank() != 0) return {};

  BenchRow row = cuda_row(ns, "all-to-all", t.device, R, tokens, o.iters);
  row.routing = o.routing == "zipf" ? "zipf(gini=" + std::to_string(o.gini).substr(0, 4) + ")" : o.routing;
  // max_rel_error stays unset: moka_ep_gpu_check checks this path against the CPU reference.
  const double copy_gbs = link.bytes_per_rank / (copy * 1e-3) / 1e9;
  // Both paths against the floor of this routing, its ceilings measured in this run.
  const LayerFloor floor = layer_floor(sh, tokens, routes, R, peak, copy_gbs);
  auto& e = row.extra;
  e["nccl_all_to_all_gbs"] = link.bytes_per_rank / (a2a * 1e-3) / 1e9;
  e["peer_copy_gbs"] = copy_gbs;
  e["dispatch_bytes_per_rank"] = link.bytes_per_rank;
  // Torch routes uniformly: its times are comparable with uniform runs only.
  const TorchResult torch = o.routing == "uniform" ? torch_result(o.torch_results, ns.name, tokens, R) : TorchResult{};
  return path_rows(row, r, floor, peak, sh, torch);
}

}  // namespace moka::cli
