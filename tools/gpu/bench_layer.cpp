#include "bench_cuda.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <istream>
#include <ostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "moka/error.hpp"
#include "moka/process_group.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/routing_gen.hpp"
#include "cuda/common/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "testing/device_tensors.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "moka/device_group.hpp"
#include "moka/moka.hpp"
#include "gpu/bench_timing.hpp"

namespace moka::cli {

// Dense bf16 cuBLAS peak of this GPU, now: 8192^3 on random data.
double dense_peak_tflops(cudaStream_t s) {
  static double cached = 0;
  if (cached > 0) return cached;
  const int n = 8192;
  Dev a(size_t(n) * n * 2), b(size_t(n) * n * 2), c(size_t(n) * n * 2);
  a.fill_normal(1.0, 1);
  b.fill_normal(1.0, 2);
  cublasHandle_t h;
  MOKA_CUBLAS_CHECK(cublasCreate(&h));
  MOKA_CUBLAS_CHECK(cublasSetStream(h, s));
  const float one = 1, zero = 0;
  const double ms = time_ms(
      [&] {
        MOKA_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.data(), CUDA_R_16BF, n, b.data(),
                                       CUDA_R_16BF, n, &zero, c.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
      },
      3, 20, s);
  cublasDestroy(h);
  cached = 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
  return cached;
}

namespace {

struct Timing {
  double fwd = 0, bwd = 0, total = 0;
};

Timing time_layer(MoeLayer& layer, const LayerTensors& t, const CudaBenchOptions& o, cudaStream_t s) {
  Timing r;
  std::unique_ptr<MoeContext> ctx;
  r.fwd = time_ms([&] { ctx = layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); }, o.warmup, o.iters, s);
  r.bwd = time_ms([&] { layer.backward(*ctx, t.d_out_view(), t.weights(), t.gradients(), Stream{s}); }, o.warmup, o.iters, s);
  r.total = time_ms(
      [&] {
        auto c = layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
        layer.backward(*c, t.d_out_view(), t.weights(), t.gradients(), Stream{s});
      },
      o.warmup, o.iters, s);
  return r;
}

// The forward gate/up grouped GEMM alone (2E groups, this routing's counts), as TFLOP/s.
double grouped_gemm_tflops(const NamedShape& ns, const LayerTensors& t, const CudaBenchOptions& o, cudaStream_t s) {
  const auto& sh = ns.shape;
  const int64_t T = t.T, H = sh.hidden, I = sh.intermediate, E = sh.num_experts, k = sh.top_k;
  const int64_t slots = T * k;
  const cuda::GroupedSchedule sched(t.ids.as<int32_t>(), t.w.as<float>(), sh, T, o.tile_rows, s);
  const int64_t rows = sched.rows;
  Dev xg(rows * H * 2), gate(rows * I * 2), up(rows * I * 2);
  xg.fill_normal(1.0, o.seed + 11);
  std::vector<cuda::GroupSpec> groups;
  for (int e = 0; e < E; ++e)
    for (int which = 0; which < 2; ++which) groups.push_back(expert_rows_group(e, 0, H, 1 + which, e * I * H, H, 3 + which, I, I, H));
  cuda::GroupedGemm gemm(groups, cuda::GemmLayout{}, 0);
  cuda::BufferTable table;
  table.ptr[0] = xg.data(), table.ptr[1] = t.wg.data(), table.ptr[2] = t.wu.data(), table.ptr[3] = gate.data(), table.ptr[4] = up.data();
  const double ms = time_ms([&] { gemm.run(table, sched.counts.as<int32_t>(), sched.offsets.as<int32_t>(), s); }, o.warmup, o.iters, s);
  return 2.0 * double(slots) * 2.0 * double(I) * double(H) / (ms * 1e-3) / 1e12;
}

// bench/torch_baseline.py's result for one shape and token count: its own fwd+bwd median and,
// when it ran with --paired-with, the median of the per-run ratios torch / moka from runs that
// alternated with moka's (`moka bench --paired-steps`) in the same device call.
struct TorchResult {
  double fwdbwd_ms = 0, fwd_ms = 0;
  double paired_ratio = 0, paired_moka_ms = 0;
  int paired_runs = 0;
};

TorchResult torch_result(const std::string& path, const std::string& shape, int64_t tokens, int ep = 1) {
  TorchResult r;
  if (path.empty()) return r;
  std::ifstream f(path);
  require(f.good(), ErrorCode::io, "cannot read torch results " + path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (j.value("shape", "") != shape || j.value("tokens_per_rank", int64_t(0)) != tokens || j.value("ep", 1) != ep)
      continue;
    r = TorchResult{j.value("fwdbwd_ms", 0.0), j.value("fwd_ms", 0.0)};
    if (j.contains("paired")) {
      const auto& p = j["paired"];
      r.paired_ratio = p.value("median_ratio", 0.0);
      r.paired_moka_ms = p.value("moka_median_ms", 0.0);
      r.paired_runs = p.value("runs", 0);
    }
  }
  return r;
}

// Random tensors and uniform routing: torch_baseline.py routes uniformly at random too, so
// expert loads match in distribution (the draws themselves differ).
void randomize_uniform(LayerTensors& t, const MoeShape& sh, int64_t tokens, uint64_t seed) {
  t.randomize(seed, core::sample_topk_ids({core::RoutingKind::uniform, 0.3, seed}, tokens, sh.top_k, sh.num_experts));
}

}  // namespace

BenchRow run_cuda_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o) {
  const CaseStream stream("moka bench --backend cuda");
  const cudaStream_t s = stream.s;
  const MoeShape& sh = ns.shape;
  const double peak = dense_peak_tflops(s);
  LayerTensors t(sh, tokens);
  randomize_uniform(t, sh, tokens, o.seed);
  const LayerOptions lo{o.tile_rows, 0};
  auto layer = make_moe_layer(sh, Backend::cuda, nullptr, lo);
  auto base = cuda::make_cuda_baseline_layer(sh, lo);
  // Check first: moka against the cuBLAS-loop path on every output element.
  {
    auto c = layer->forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
    layer->backward(*c, t.d_out_view(), t.weights(), t.gradients(), Stream{s});
  }
  const auto out_m = read_bf16(t.out), dx_m = read_bf16(t.d_x), dwd_m = read_bf16(t.dwd);
  {
    auto c = base->forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
    base->backward(*c, t.d_out_view(), t.weights(), t.gradients(), Stream{s});
  }
  const double err = std::max({rel_diff(out_m, read_bf16(t.out)), rel_diff(dx_m, read_bf16(t.d_x)),
                               rel_diff(dwd_m, read_bf16(t.dwd))});
  const Timing m = time_layer(*layer, t, o, s);
  const Timing b = time_layer(*base, t, o, s);
  base.reset();  // its workspace, before the fused layer allocates one
  const double gemm = grouped_gemm_tflops(ns, t, o, s);

  // SwiGLU in the gate GEMM's epilogue against the default unfused path (gate|up GEMM, then the
  // activation pass): the same bits (checked on out, d_x, d_w_down), forward timed alternately.
  LayerOptions fused_options = lo;
  fused_options.fused_swiglu = true;
  auto fused = make_moe_layer(sh, Backend::cuda, nullptr, fused_options);
  {
    auto c = fused->forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
    fused->backward(*c, t.d_out_view(), t.weights(), t.gradients(), Stream{s});
  }
  auto same_bits = [](const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  const bool fused_identical =
      same_bits(read_bf16(t.out), out_m) && same_bits(read_bf16(t.d_x), dx_m) && same_bits(read_bf16(t.dwd), dwd_m);
  const Paired fwd = time_paired([&] { fused->forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); },
                                 [&] { layer->forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); }, o.warmup, o.iters, s);

  BenchRow row;
  row.shape = ns.name;
  row.backend = "cuda";
  row.path = "grouped";
  cudaDeviceProp prop;
  MOKA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  row.device = prop.name;
  row.dtype = "bf16";
  row.routing = "uniform";
  row.tokens_per_rank = tokens;
  row.iters = o.iters;
  row.fwd_ms = m.fwd;
  row.bwd_ms = m.bwd;
  row.fwdbwd_ms = m.total;
  row.tflops = 3.0 * sh.forward_flops(tokens) / (m.total * 1e-3) / 1e12;
  row.max_rel_error = err;
  const TorchResult torch = torch_result(o.torch_results, ns.name, tokens);
  auto& e = row.extra;
  e["dense_peak_tflops"] = peak;
  e["grouped_gemm_tflops"] = gemm;
  e["grouped_gemm_pct_peak"] = 100.0 * gemm / peak;
  e["baseline_fwd_ms"] = b.fwd;
  e["baseline_bwd_ms"] = b.bwd;
  e["baseline_fwdbwd_ms"] = b.total;
  e["speedup_vs_cublas_loop"] = b.total / m.total;
  e["error_vs"] = "cublas-loop";
  e["fused_swiglu_fwd_ms"] = fwd.a_ms;
  e["unfused_swiglu_fwd_ms"] = fwd.b_ms;
  e["fused_swiglu_fwd_speedup"] = fwd.ratio;
  e["fused_swiglu_identical"] = fused_identical;
  if (torch.fwdbwd_ms > 0) {
    e["torch_fwdbwd_ms"] = torch.fwdbwd_ms;
    e["speedup_vs_torch"] = torch.fwdbwd_ms / m.total;
  }
  if (torch.paired_runs > 0) {
    e["speedup_vs_torch_paired"] = torch.paired_ratio;
    e["paired_runs"] = torch.paired_runs;
    e["paired_moka_fwdbwd_ms"] = torch.paired_moka_ms;
  }
  return row;
}

void serve_cuda_steps(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o, std::istream& in,
                      std::ostream& out) {
  const CaseStream stream("moka bench --paired-steps");
  const MoeShape& sh = ns.shape;
  LayerTensors t(sh, tokens);
  randomize_uniform(t, sh, tokens, o.seed);
  auto layer = make_moe_layer(sh, Backend::cuda, nullptr, LayerOptions{o.tile_rows, 0});
  auto step = [&] {
    auto c = layer->forward(t.inputs(), t.weights(), t.out_view(), Stream{stream.s});
    layer->backward(*c, t.d_out_view(), t.weights(), t.gradients(), Stream{stream.s});
  };
  for (int i = 0; i < o.warmup; ++i) step();
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  out << "ready" << std::endl;
  std::string line;
  while (std::getline(in, line) && line == "step")
    out << std::setprecision(9) << time_ms(step, 0, 1, stream.s) << std::endl;
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
  Dev send(bytes_per_peer * R), recv(bytes_per_peer * R);
  std::vector<size_t> counts(R, bytes_per_peer), offsets(R);
  for (int p = 0; p < R; ++p) offsets[p] = p * bytes_per_peer;
  t.all_to_all_ms = time_ms([&] { g.all_to_all_v(send.data(), counts.data(), offsets.data(), recv.data(), counts.data(), offsets.data(), s); },
                            o.warmup, o.iters, s);
  const SymmetricBuffer& peer = g.allocate_symmetric(bytes_per_peer * (R - 1));
  const int next = (g.rank() + 1) % R;
  g.device_barrier(s, 30.0);
  t.peer_copy_ms = time_ms([&] {
    MOKA_CUDA_CHECK(cudaMemcpyAsync(recv.data(), peer.peers[next], bytes_per_peer * (R - 1), cudaMemcpyDeviceToDevice, s));
  }, o.warmup, o.iters, s);
  g.device_barrier(s, 30.0);
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  g.check_device_errors();
  return t;
}

// This rank's top-k ids for an expert-parallel case (o.routing; see CudaBenchOptions).
std::vector<int32_t> ep_routing(const CudaBenchOptions& o, const MoeShape& sh, int64_t tokens, int rank, int ranks) {
  const auto stream = static_cast<uint64_t>(rank);
  if (o.routing == "one-rank") return core::sample_topk_ids({core::RoutingKind::uniform, 0, o.seed}, tokens,
                                                            sh.top_k, sh.num_experts / ranks, stream);
  const auto kind = o.routing == "zipf" ? core::RoutingKind::zipf : core::parse_routing_kind(o.routing);
  return core::sample_topk_ids({kind, o.gini, o.seed}, tokens, sh.top_k, sh.num_experts, stream);
}

// routes[s * R + r]: routes from rank s's tokens to the experts rank r hosts, over all workers.
std::vector<int64_t> route_matrix(ProcessGroup& workers, const std::vector<int32_t>& ids, int64_t experts_per_rank) {
  const int R = workers.size();
  std::vector<int64_t> mine(R, 0), all(size_t(R) * R);
  for (int32_t id : ids) mine[id / experts_per_rank]++;
  workers.all_gather(mine.data(), all.data(), R * sizeof(int64_t));
  return all;
}

// The floor of one forward, for the slowest rank: the most routed rows any rank computes (plus
// the shared expert) at the dense peak, and the most rows any rank must receive over NVLink
// (rows it pulls from peers + outputs peers push back for its own tokens) at the peer-copy rate.
struct Floor {
  double flops_ms = 0, bytes_ms = 0;
};
Floor layer_floor(const MoeShape& sh, int64_t tokens, const std::vector<int64_t>& routes, int R, double peak_tflops,
                  double copy_gbs) {
  int64_t most_rows = 0, most_inbound = 0;
  for (int r = 0; r < R; ++r) {
    int64_t rows = 0, inbound = 0;
    for (int s = 0; s < R; ++s) {
      rows += routes[s * R + r];
      if (s != r) inbound += routes[s * R + r] + routes[r * R + s];
    }
    most_rows = std::max(most_rows, rows);
    most_inbound = std::max(most_inbound, inbound);
  }
  const double flops = 6.0 * double(most_rows) * sh.hidden * sh.intermediate +
                       6.0 * double(tokens) * sh.hidden * sh.shared_intermediate;
  return {flops / (peak_tflops * 1e12) * 1e3, double(most_inbound) * sh.hidden * 2 / (copy_gbs * 1e9) * 1e3};
}

void write_timeline(const std::string& path, const std::string& shape, int64_t tokens, int ep,
                    const std::vector<MegakernelTaskSpan>& spans) {
  std::ofstream f(path);
  require(f.good(), ErrorCode::io, "cannot write timeline " + path);
  int64_t t0 = spans.empty() ? 0 : spans.front().start_ns;
  for (const auto& t : spans) t0 = std::min(t0, t.start_ns);
  for (const auto& t : spans)
    f << nlohmann::json{{"shape", shape}, {"tokens_per_rank", tokens}, {"ep", ep}, {"cta", t.cta},
                        {"kind", t.kind}, {"step", t.step}, {"row_tile", t.row_tile},
                        {"start_us", (t.start_ns - t0) / 1e3}, {"end_us", (t.end_ns - t0) / 1e3}}
             .dump()
      << "\n";
}

// The megakernel forward next to the all-to-all path's forward on the same tensors: paired
// times, the largest relative difference of their outputs, and (first case only, if asked) the
// megakernel's task timeline.
struct MegakernelTiming {
  Paired fwd;  // a: all-to-all path, b: megakernel
  double max_rel_diff = 0;
};
MegakernelTiming time_megakernel(MoeLayer& layer, DeviceGroup* group, const NamedShape& ns, const LayerTensors& t,
                                 const CudaBenchOptions& o, cudaStream_t s) {
  auto mk = megakernel_layer(ns.shape, group, o.megakernel, t.T);
  MegakernelTiming r;
  layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto want = read_bf16(t.out);
  mk->forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  mk->check_errors();
  r.max_rel_diff = rel_diff(read_bf16(t.out), want);
  r.fwd = time_paired([&] { layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); },
                      [&] { mk->forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); }, o.warmup, o.iters, s);
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  mk->check_errors();
  if (!o.timeline.empty()) {
    mk->megakernel()->record_timeline(true);
    mk->forward(t.inputs(), t.weights(), t.out_view(), Stream{s});
    MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
    mk->check_errors();
    const int rank = group ? group->rank() : 0;
    if (rank == 0) write_timeline(o.timeline, ns.name, t.T, group ? group->size() : 1, mk->megakernel()->timeline());
  }
  return r;
}

}  // namespace

void select_worker_device(int local_rank) { MOKA_CUDA_CHECK(cudaSetDevice(local_rank)); }

std::optional<BenchRow> run_cuda_ep_case(ProcessGroup& workers, const NamedShape& ns, int64_t tokens,
                                         const CudaBenchOptions& o) {
  const MoeShape& sh = ns.shape;
  const int R = workers.size();
  cudaStream_t s;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
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
  auto layer = make_moe_layer(sh, group.get(), all_to_all);
  const Timing m = time_layer(*layer, t, o, s);
  // Uniform routing sends about T*k/R rows to each rank: time that much through NCCL and
  // through a plain peer copy.
  const size_t rows_per_peer = static_cast<size_t>(tokens * sh.top_k / R);
  const LinkTiming link = time_links(*group, rows_per_peer * sh.hidden * 2, o, s);
  const double peak = dense_peak_tflops(s);
  const MegakernelTiming mk = time_megakernel(*layer, group.get(), ns, t, o, s);
  layer.reset();
  MOKA_CUDA_CHECK(cudaStreamDestroy(s));
  const double fwd = max_over_ranks(workers, m.fwd), bwd = max_over_ranks(workers, m.bwd);
  const double total = max_over_ranks(workers, m.total);
  const double a2a = max_over_ranks(workers, link.all_to_all_ms), copy = max_over_ranks(workers, link.peer_copy_ms);
  const double mk_fwd = max_over_ranks(workers, mk.fwd.b_ms);
  if (workers.rank() != 0) return std::nullopt;

  BenchRow row = ep_row(ns, "all-to-all", t.device, R, tokens, o.iters);
  row.routing = o.routing == "zipf" ? "zipf(gini=" + std::to_string(o.gini).substr(0, 4) + ")" : o.routing;
  row.fwd_ms = fwd;
  row.bwd_ms = bwd;
  row.fwdbwd_ms = total;
  row.tflops = 3.0 * sh.forward_flops(tokens) / (total * 1e-3) / 1e12;
  // max_rel_error stays unset: moka_ep_gpu_check checks this path against the CPU reference.
  const double gbs = [&](double ms) { return link.bytes_per_rank / (ms * 1e-3) / 1e9; }(a2a);
  const double copy_gbs = link.bytes_per_rank / (copy * 1e-3) / 1e9;
  // Torch routes uniformly: its times are comparable with uniform runs only.
  const TorchResult torch = o.routing == "uniform" ? torch_result(o.torch_results, ns.name, tokens, R) : TorchResult{};
  const double tms = torch.fwdbwd_ms;
  auto& e = row.extra;
  e["nccl_all_to_all_gbs"] = gbs;
  e["peer_copy_gbs"] = copy_gbs;
  e["dispatch_bytes_per_rank"] = link.bytes_per_rank;
  e["times"] = "max over ranks of per-rank medians";
  if (tms > 0) {
    e["torch_fwdbwd_ms"] = tms;
    e["speedup_vs_torch"] = tms / total;
  }
  // The megakernel forward against its floor (both ceilings measured in this run).
  const Floor f = layer_floor(sh, tokens, routes, R, peak, copy_gbs);
  const double flops_floor = f.flops_ms, bytes_floor = f.bytes_ms;
  const double floor = std::max(flops_floor, bytes_floor);
  const double torch_fwd = torch.fwd_ms;
  e["megakernel_fwd_ms"] = mk_fwd;
  e["all_to_all_fwd_ms_paired"] = mk.fwd.a_ms;
  e["megakernel_speedup_vs_all_to_all"] = 1.0 / mk.fwd.ratio;
  e["megakernel_max_rel_diff_vs_all_to_all"] = mk.max_rel_diff;
  e["dense_peak_tflops"] = peak;
  e["floor_ms"] = floor;
  e["floor_flops_ms"] = flops_floor;
  e["floor_bytes_ms"] = bytes_floor;
  e["megakernel_vs_floor"] = mk_fwd / floor;
  e["megakernel_config"] = "comm_sms=" + std::to_string(o.megakernel.num_comm_sms) +
                           " minibatch=" + std::to_string(o.megakernel.minibatch_size) +
                           " macrobatch=" + std::to_string(o.megakernel.macrobatch_size) +
                           " band_row_tiles=" + std::to_string(o.megakernel.band_row_tiles) + " row_order=" +
                           (o.megakernel.row_order == RowOrder::rate_based ? "rate_based" : "round_robin");
  if (torch_fwd > 0) {
    e["torch_fwd_ms"] = torch_fwd;
    e["megakernel_speedup_vs_torch_fwd"] = torch_fwd / mk_fwd;
  }
  return row;
}

}  // namespace moka::cli
