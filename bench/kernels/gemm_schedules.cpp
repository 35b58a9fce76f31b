// gemm_schedules: the single-GPU layer's grouped GEMMs one by one, each with both CUTLASS kernel
// schedules (cuda::GemmSchedule: cooperative, the layer's today, and ping-pong). For every named
// shape and token count: uniform routing as `moka bench` draws it, the layer's single-GPU schedule
// (expert segments back to back), and each launch's own groups and layout
// (cuda::staged::layer_gemm_specs, what build_layer_gemms builds). Per role the ping-pong output
// is checked against the cooperative one (max_rel_error, identical_to_cooperative: it fails above
// 2e-2), then both are timed alternately (median of --iters after --warmup) against the dense
// cuBLAS peak measured in the same process. One JSON line per role and schedule.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "core/routing_gen.hpp"
#include "cuda/layer/layer_gemms.hpp"
#include "kernel_lab.hpp"

namespace moka::lab {
namespace {

using cuda::GemmSchedule;
using cuda::GroupSpec;
using cuda::Major;
using cuda::staged::LayerGemmSpec;
using cuda::staged::LayerGemmSpecs;

// The layer's launches, by the names the rows give them: gate|up (one launch), down, the data
// gradients dh = dY W_down and dx = [dG W_gate, dU W_up], the weight gradients of down and of
// gate and up (one launch: its two groups per expert side by side).
struct Role {
  const char* name;
  LayerGemmSpec LayerGemmSpecs::*spec;
};
constexpr Role kRoles[] = {
    {"gate_up", &LayerGemmSpecs::gate_up},
    {"down", &LayerGemmSpecs::down},
    {"dh", &LayerGemmSpecs::data_grad_h},
    {"dx", &LayerGemmSpecs::data_grad_x},
    {"wgrad_down", &LayerGemmSpecs::weight_grad_down},
    {"wgrad_gate_up", &LayerGemmSpecs::weight_grad_gate_up},
};

std::vector<std::string> role_names() {
  std::vector<std::string> names;
  for (const Role& r : kRoles) names.push_back(r.name);
  return names;
}

struct Options {
  CaseOptions cases;
  std::vector<std::string> roles = role_names();
};

// A group's (m, n, k) and first grouped row for this routing, as the setup kernel resolves them
// (grouped_gemm.cu): the count dimension takes the expert's rows, an empty expert gets m = 0.
struct Problem {
  int64_t m = 0, n = 0, k = 0, row = 0;
};
Problem resolve(const GroupSpec& g, const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets) {
  int64_t dims[3] = {g.m, g.n, g.k};
  int64_t row = 0;
  if (g.expert >= 0) {
    const int32_t count = counts[g.expert];
    row = offsets[g.expert];
    dims[static_cast<int>(g.count_dim)] = count;
    if (count == 0) dims[0] = 0;
  }
  return {dims[0], dims[1], dims[2], row};
}

// Elements of each buffer the groups touch (one past the last), so every buffer is allocated at
// the size the layer's would have for this routing.
void extend_extents(const LayerGemmSpec& spec, const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets,
                    std::vector<int64_t>& extent) {
  for (const GroupSpec& g : spec.groups) {
    const Problem p = resolve(g, counts, offsets);
    if (p.m == 0 || p.n == 0 || p.k == 0) continue;  // no tiles: nothing is read or written
    auto reach = [&](int buf, int64_t first, int64_t end) { extent[buf] = std::max(extent[buf], first + end); };
    // K-major A is [m, k] with row pitch lda, MN-major A [k, m]; likewise B with n; D is [m, n].
    reach(g.a, g.a_off + p.row * g.a_step,
          spec.layout.a == Major::k ? (p.m - 1) * g.lda + p.k : (p.k - 1) * g.lda + p.m);
    reach(g.b, g.b_off + p.row * g.b_step,
          spec.layout.b == Major::k ? (p.n - 1) * g.ldb + p.k : (p.k - 1) * g.ldb + p.n);
    reach(g.d, g.d_off + p.row * g.d_step, (p.m - 1) * g.ldd + p.n);
  }
}

// max |got - want| and max |want| over two bf16 device buffers of the same size, and whether
// they hold the same bits; read back in chunks (a weight gradient of deepseek-v3 is 7.5 GB).
struct Comparison {
  double diff = 0, scale = 0;
  bool identical = true;
  double relative() const { return scale > 0 ? diff / scale : diff; }
  void add(const Dev& got, const Dev& want) {
    constexpr size_t kChunk = size_t{1} << 27;  // bytes per read
    for (size_t at = 0; at < want.bytes(); at += kChunk) {
      const size_t bytes = std::min(kChunk, want.bytes() - at);
      const auto g = cli::read_bf16(got.as<char>() + at, bytes), w = cli::read_bf16(want.as<char>() + at, bytes);
      if (std::memcmp(g.data(), w.data(), bytes) != 0) identical = false;
      for (size_t i = 0; i < w.size(); ++i) {
        const double x = __bfloat162float(g[i]), y = __bfloat162float(w[i]);
        diff = std::max(diff, std::isfinite(x) ? std::abs(x - y) : INFINITY);
        scale = std::max(scale, std::abs(y));
      }
    }
  }
};

const char* schedule_name(GemmSchedule s) { return s == GemmSchedule::pingpong ? "pingpong" : "cooperative"; }
const char* tile_of(GemmSchedule s) { return s == GemmSchedule::pingpong ? "128x128x64" : "128x256x64"; }
std::string layout_name(const cuda::GemmLayout& l) {
  auto m = [](Major x) { return x == Major::k ? "k" : "mn"; };
  return std::string(m(l.a)) + "," + m(l.b);
}

constexpr double kTolerance = 2e-2;

void run_case(const NamedShape& ns, int64_t tokens, const Options& o) {
  const cli::CaseStream stream("gemm_schedules");
  const cudaStream_t s = stream.s;
  const MoeShape& sh = ns.shape;
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  const double peak = cli::dense_peak_tflops(s);

  // The routing and the single-GPU layer's schedule of it (tile_rows 1: segments back to back).
  const auto topk =
      core::sample_topk_ids({core::RoutingKind::uniform, 0.3, o.cases.seed}, tokens, sh.top_k, sh.num_experts);
  std::vector<float> weights(topk.size());
  std::mt19937_64 rng(o.cases.seed);
  std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
  for (float& w : weights) w = uniform(rng);
  Dev ids(topk.size() * 4), route_weights(weights.size() * 4);
  ids.upload(topk.data());
  route_weights.upload(weights.data());
  const fixtures::GroupedSchedule sched(ids.as<int32_t>(), route_weights.as<float>(), sh, tokens, 1, s);
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<int32_t> counts(sh.num_experts), offsets(sh.num_experts + 1);
  MOKA_CUDA_CHECK(cudaMemcpy(counts.data(), sched.counts.data(), counts.size() * 4, cudaMemcpyDeviceToHost));
  MOKA_CUDA_CHECK(cudaMemcpy(offsets.data(), sched.offsets.data(), offsets.size() * 4, cudaMemcpyDeviceToHost));

  // The layer's launches and every buffer they touch: inputs N(0, 1), outputs zeroed per run.
  const LayerGemmSpecs specs = cuda::staged::layer_gemm_specs(sh, sh.num_experts, tokens);
  std::vector<const Role*> roles;
  for (const Role& r : kRoles)
    if (std::find(o.roles.begin(), o.roles.end(), r.name) != o.roles.end()) roles.push_back(&r);
  std::vector<int64_t> extent(cuda::staged::kNumBufs, 0);
  std::set<int> outputs_of_all;
  for (const Role* r : roles) {
    extend_extents(specs.*r->spec, counts, offsets, extent);
    for (const GroupSpec& g : (specs.*r->spec).groups) outputs_of_all.insert(g.d);
  }
  std::vector<Dev> buffers;
  cuda::BufferTable table;
  for (int b = 0; b < cuda::staged::kNumBufs; ++b) {
    buffers.emplace_back(static_cast<size_t>(extent[b]) * 2);
    if (extent[b] > 0 && !outputs_of_all.count(b)) buffers[b].fill_normal(1.0, o.cases.seed + 100 + b);
    table.ptr[b] = buffers[b].data();
  }
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());  // the fills ran on the legacy stream

  for (const Role* r : roles) {
    const LayerGemmSpec& spec = specs.*r->spec;
    std::set<int> outputs;
    double flops = 0;
    for (const GroupSpec& g : spec.groups) {
      outputs.insert(g.d);
      const Problem p = resolve(g, counts, offsets);
      flops += 2.0 * double(p.m) * double(p.n) * double(p.k);
    }
    const GemmSchedule schedules[2] = {GemmSchedule::cooperative, GemmSchedule::pingpong};
    std::unique_ptr<cuda::GroupedGemm> gemm[2];
    for (int i = 0; i < 2; ++i) {
      cuda::GemmLayout layout = spec.layout;
      layout.schedule = schedules[i];
      gemm[i] = std::make_unique<cuda::GroupedGemm>(spec.groups, layout, device);
    }
    auto run = [&](int i) { gemm[i]->run(table, sched.counts.as<int32_t>(), sched.offsets.as<int32_t>(), s); };
    auto clear_and_run = [&](int i) {
      for (int b : outputs) MOKA_CUDA_CHECK(cudaMemsetAsync(buffers[b].data(), 0, buffers[b].bytes(), s));
      run(i);
      MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
    };
    // The check: the cooperative outputs kept aside, then the ping-pong ones compared with them.
    Comparison cmp;
    {
      clear_and_run(0);
      std::vector<Dev> want;
      for (int b : outputs) {
        want.emplace_back(buffers[b].bytes());
        MOKA_CUDA_CHECK(
            cudaMemcpy(want.back().data(), buffers[b].data(), buffers[b].bytes(), cudaMemcpyDeviceToDevice));
      }
      clear_and_run(1);
      size_t i = 0;
      for (int b : outputs) cmp.add(buffers[b], want[i++]);
    }
    const cli::Paired t = cli::time_paired([&] { run(0); }, [&] { run(1); }, o.cases.warmup, o.cases.iters, s);
    for (int i = 0; i < 2; ++i) {
      const double ms = i == 0 ? t.a_ms : t.b_ms;
      const double tflops = flops / (ms * 1e-3) / 1e12;
      BenchRow row = cli::cuda_row(ns, "grouped-gemm", device, 1, tokens, o.cases.iters);
      row.tflops = tflops;
      auto& e = row.extra;
      e["role"] = r->name;
      e["schedule"] = schedule_name(schedules[i]);
      e["tile"] = tile_of(schedules[i]);
      e["layout"] = layout_name(spec.layout);
      e["layer_schedule"] = schedule_name(spec.layout.schedule);
      e["groups"] = spec.groups.size();
      e["gemm_flops"] = flops;
      e["gemm_ms"] = ms;
      e["gemm_tflops"] = tflops;
      e["pct_peak"] = 100.0 * tflops / peak;
      e["dense_peak_tflops"] = peak;
      if (schedules[i] == GemmSchedule::pingpong) {
        row.max_rel_error = cmp.relative();
        e["error_vs"] = "cooperative";
        e["identical_to_cooperative"] = cmp.identical;
        e["speedup_vs_cooperative"] = 1.0 / t.ratio;  // 1 / the median of the paired runs' pingpong/cooperative
      }
      e["times"] = "medians of runs alternating cooperative and pingpong";
      print_json_line(row);
    }
    require(cmp.relative() <= kTolerance, ErrorCode::internal,
            std::string("the ping-pong ") + r->name + " GEMM differs from the cooperative one: max relative error " +
                std::to_string(cmp.relative()));
  }
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  Options o;
  CLI::App app{"The single-GPU layer's grouped GEMMs, each with the cooperative and the ping-pong kernel (one GPU)",
               "gemm_schedules"};
  add_case_options(app, o.cases);
  app.add_option("--roles", o.roles, "The layer's grouped GEMMs to run (comma list)")
      ->delimiter(',')
      ->check(CLI::IsMember(role_names()));
  return lab_main(app, argc, argv, [&] {
    std::vector<moka::NamedShape> shapes;
    for (const std::string& name : o.cases.shapes) shapes.push_back(moka::named_shape(name));  // all, before any work
    for (const moka::NamedShape& ns : shapes)
      for (int64_t tokens : o.cases.tokens) run_case(ns, tokens, o);
  });
}
