// gemm_schedules: the single-GPU layer's grouped GEMMs one by one, each with every CUTLASS kernel
// schedule (cuda::GemmSchedule: cooperative, the layer's today, and the ping-pong ones). For every
// named shape and token count: uniform routing, the layer's single-GPU schedule of it (expert
// segments back to back), and each launch's own groups and layout (cuda::staged::
// layer_gemm_specs, what build_layer_gemms builds). Per role, first the check at full size, on the
// device and on the case's stream alone: the cooperative kernel run twice into two sets of outputs
// must agree bit for bit (the harness's control), then each other schedule's outputs are compared
// with the cooperative ones (every output first filled with a NaN pattern, so an element a kernel
// never wrote shows as such); one `grouped-gemm-check` line per role and schedule. A schedule that
// differs (beyond kTolerance, or in any element one kernel wrote and the other did not) is not
// timed, and the run exits 2 at the end. Then the cooperative kernel and every schedule that
// passed run in turn, --iters rounds after --warmup, timed against the dense cuBLAS peak measured
// in the same process: one `grouped-gemm` line per role and schedule.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/routing_gen.hpp"
#include "cuda/common/check.hpp"
#include "cuda/layer/layer_gemms.hpp"
#include "gemm_compare.hpp"
#include "kernel_lab.hpp"
#include "moka/error.hpp"

namespace moka::lab {
namespace {

using cuda::GemmSchedule;
using cuda::GroupSpec;
using cuda::GroupProblem;
using cuda::resolve_group;
using cuda::Major;
using cuda::staged::LayerGemmSpec;
using cuda::staged::LayerGemmSpecs;

// The layer's launches, by the names the rows give them, in the order they run here: the weight
// gradients of down and of gate and up (one launch: two groups per expert; K = an expert's rows,
// the short-K products the ping-pong schedules are for, first), the data gradients dh = dY W_down
// and dx = [dG W_gate, dU W_up], down, gate|up (one launch, the unfused forward's) and up (the
// fused forward's first launch; its gate launch has the SwiGLU epilogue, cooperative only).
struct Role {
  const char* name;
  LayerGemmSpec LayerGemmSpecs::*spec;
};
constexpr Role kRoles[] = {
    {"wgrad_down", &LayerGemmSpecs::weight_grad_down},
    {"wgrad_gate_up", &LayerGemmSpecs::weight_grad_gate_up},
    {"dh", &LayerGemmSpecs::data_grad_h},
    {"dx", &LayerGemmSpecs::data_grad_x},
    {"down", &LayerGemmSpecs::down},
    {"gate_up", &LayerGemmSpecs::gate_up},
    {"up", &LayerGemmSpecs::up},
};

struct Schedule {
  const char* name;
  GemmSchedule schedule;
  const char* tile;  // per consumer warpgroup for the ping-pong ones
  const char* cluster;
};
constexpr Schedule kCooperative{"cooperative", GemmSchedule::cooperative, "128x256x64", "1x1x1"};
constexpr Schedule kOthers[] = {
    {"pingpong", GemmSchedule::pingpong, "128x128x64", "1x1x1"},
    {"pingpong_multicast", GemmSchedule::pingpong_multicast, "128x128x64", "2x1x1"},
};
const char* schedule_name(GemmSchedule s) {
  for (const Schedule& o : kOthers)
    if (o.schedule == s) return o.name;
  return kCooperative.name;
}

template <class T, size_t N>
std::vector<std::string> names_of(const T (&items)[N]) {
  std::vector<std::string> names;
  for (const T& i : items) names.push_back(i.name);
  return names;
}

// The check's bound on max |got - want| / max |want|: two bf16 ulps at the largest output. The
// kernels accumulate every element over the same k-blocks in the same order, so they are
// expected to agree bit for bit (`identical`); a wrong tile differs by O(1).
constexpr double kTolerance = 1.0 / 128;

struct Options {
  CaseOptions cases;
  std::vector<std::string> roles = names_of(kRoles);
  std::vector<std::string> schedules = names_of(kOthers);
};

// Elements of each operand buffer the groups read (one past the last), so every buffer is
// allocated at the size the layer's would have for this routing; outputs likewise.
void extend_extents(const LayerGemmSpec& spec, const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets,
                    std::vector<int64_t>& inputs, std::vector<int64_t>& outputs) {
  for (const GroupSpec& g : spec.groups) {
    const GroupProblem p = resolve_group(g, counts.data(), offsets.data());
    if (p.m == 0 || p.n == 0 || p.k == 0) continue;  // no tiles: nothing is read or written
    auto reach = [](std::vector<int64_t>& extent, int buf, int64_t first, int64_t end) {
      extent[buf] = std::max(extent[buf], first + end);
    };
    // K-major A is [m, k] with row pitch lda, MN-major A [k, m]; likewise B with n; D is [m, n].
    reach(inputs, g.a, g.a_off + p.row * g.a_step,
          spec.layout.a == Major::k ? (p.m - 1) * g.lda + p.k : (p.k - 1) * g.lda + p.m);
    reach(inputs, g.b, g.b_off + p.row * g.b_step,
          spec.layout.b == Major::k ? (p.n - 1) * g.ldb + p.k : (p.k - 1) * g.ldb + p.n);
    reach(outputs, g.d, g.d_off + p.row * g.d_step, (p.m - 1) * g.ldd + p.n);
  }
}

// Which group of `spec` wrote element `at` of buffer `buf`, as "group G (expert E) row R col C":
// where a difference is, for the check's line.
std::string locate(const LayerGemmSpec& spec, const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets,
                   int buf, int64_t at) {
  for (size_t i = 0; i < spec.groups.size(); ++i) {
    const GroupSpec& g = spec.groups[i];
    const GroupProblem p = resolve_group(g, counts.data(), offsets.data());
    if (g.d != buf || p.m == 0) continue;
    const int64_t rel = at - (g.d_off + p.row * g.d_step), r = rel / g.ldd, c = rel % g.ldd;
    if (rel >= 0 && r < p.m && c < p.n) {
      std::ostringstream out;
      out << "group " << i << " (expert " << g.expert << ", m " << p.m << " n " << p.n << " k " << p.k << ") row " << r
          << " col " << c;
      return out.str();
    }
  }
  return "no group's output";
}

// One role's check of one schedule against the cooperative outputs, over every output buffer.
struct Check {
  unsigned long long differing = 0, unwritten = 0, extra = 0, non_finite = 0;
  double max_diff = 0, max_want = 0;
  std::string first;  // where the first difference is, with both values
  bool identical() const { return differing == 0; }
  double relative() const { return max_want > 0 ? max_diff / max_want : max_diff; }
  bool passed() const {
    return unwritten == 0 && extra == 0 && non_finite == 0 && std::isfinite(relative()) && relative() <= kTolerance;
  }
};

struct Case {
  const NamedShape& ns;
  int64_t tokens;
  cudaStream_t s;
  int device;
  std::vector<int32_t> counts, offsets;
  const Dev& device_counts;
  const Dev& device_offsets;
  const cuda::BufferTable& inputs;  // the operands every role reads; outputs are per role
};

// The outputs of one role: one set per kernel under comparison, each in its own buffer table.
struct Outputs {
  std::vector<int> bufs;
  std::vector<Dev> ref, test;
  cuda::BufferTable ref_table, test_table;
  void fill_unwritten(const std::vector<Dev>& set, cudaStream_t s) const {
    for (const Dev& d : set) MOKA_CUDA_CHECK(cudaMemsetAsync(d.data(), 0xFF, d.bytes(), s));
  }
};

// Waits for `s`, polling: a kernel that has not finished within kHangSeconds (a deadlocked
// schedule; the largest check here takes well under a second) ends the process with exit code 4
// and a line naming it, rather than holding the GPU until an outer timeout.
constexpr double kHangSeconds = 60;
void wait_or_exit(cudaStream_t s, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) MOKA_CUDA_CHECK(q);
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > kHangSeconds) {
      std::cerr << "gemm_schedules: " + what + " has not finished after " + std::to_string(int(kHangSeconds)) +
                       " s (hung?): exiting\n";
      std::_Exit(4);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Check compare_outputs(const Case& c, const LayerGemmSpec& spec, const Outputs& out, const Dev& diffs,
                      const std::string& spec_name) {
  auto* d = diffs.as<BufferDiff>();
  for (size_t i = 0; i < out.bufs.size(); ++i)
    compare_bf16(out.test[i].data(), out.ref[i].data(), out.ref[i].bytes() / 2, d + i, c.s);
  std::vector<BufferDiff> h(out.bufs.size());
  MOKA_CUDA_CHECK(cudaMemcpyAsync(h.data(), d, h.size() * sizeof(BufferDiff), cudaMemcpyDeviceToHost, c.s));
  wait_or_exit(c.s, spec_name);
  Check k;
  for (size_t i = 0; i < h.size(); ++i) {
    const BufferDiff& b = h[i];
    k.differing += b.differing, k.unwritten += b.unwritten, k.extra += b.extra, k.non_finite += b.non_finite;
    k.max_diff = std::max<double>(k.max_diff, float_of_bits(b.max_diff_bits));
    k.max_want = std::max<double>(k.max_want, float_of_bits(b.max_want_bits));
    if (b.differing > 0 && k.first.empty()) {
      std::ostringstream o;
      o << "buffer " << out.bufs[i] << " element " << b.first << ": "
        << locate(spec, c.counts, c.offsets, out.bufs[i], int64_t(b.first)) << ", got "
        << float_of_bf16_bits(b.first_got) << " want " << float_of_bf16_bits(b.first_want);
      k.first = o.str();
    }
  }
  return k;
}

// Median milliseconds of each kernel, run in turn (kernel 0, 1, ..., 0, 1, ...) so drifting
// clocks and temperatures affect all alike, and each one's median ratio to kernel 0's time.
struct Times {
  std::vector<double> ms, ratio_to_first;
};
Times time_in_turn(const std::vector<std::function<void()>>& runs, int warmup, int iters, cudaStream_t s) {
  std::vector<std::vector<double>> ms(runs.size());
  for (int i = 0; i < warmup + iters; ++i)
    for (size_t j = 0; j < runs.size(); ++j) {
      const double t = cli::time_ms(runs[j], 0, 1, s);
      if (i >= warmup) ms[j].push_back(t);
    }
  Times t;
  for (size_t j = 0; j < runs.size(); ++j) {
    t.ms.push_back(cli::median(ms[j]));
    t.ratio_to_first.push_back(cli::median_ratio(ms[0], ms[j]));
  }
  return t;
}

std::string layout_name(const cuda::GemmLayout& l) {
  auto m = [](Major x) { return x == Major::k ? "k" : "mn"; };
  return std::string(m(l.a)) + "," + m(l.b);
}

// One line per role for the summary on stderr at the end (the JSON lines of three shapes run to
// ~100 KB): each schedule's time, share of the peak, speedup and check, or its failed check.
std::vector<std::string> summary;
// Prints the summary when the run ends, however it ends.
struct SummaryAtExit {
  ~SummaryAtExit() {
    if (summary.empty()) return;
    std::string text = "gemm_schedules summary (median ms, share of the dense peak, speedup over cooperative):\n";
    for (const std::string& l : summary) text += "  " + l + "\n";
    std::cerr << text << std::flush;
  }
};
std::string decimals(double x, int digits) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(digits);
  o << x;
  return o.str();
}

// One role: the check, then the times. Returns the schedules that failed the check.
std::vector<std::string> run_role(const Case& c, const Role& role, const LayerGemmSpec& spec,
                                  const std::vector<const Schedule*>& schedules, const Options& o, double peak) {
  std::vector<int64_t> unused(cuda::staged::kNumBufs, 0), extent(cuda::staged::kNumBufs, 0);
  extend_extents(spec, c.counts, c.offsets, unused, extent);
  Outputs out;
  out.ref_table = out.test_table = c.inputs;
  std::set<int> bufs;
  for (const GroupSpec& g : spec.groups) bufs.insert(g.d);
  for (int b : bufs) {
    out.bufs.push_back(b);
    out.ref.emplace_back(size_t(extent[b]) * 2);
    out.test.emplace_back(size_t(extent[b]) * 2);
    out.ref_table.ptr[b] = out.ref.back().data();
    out.test_table.ptr[b] = out.test.back().data();
  }
  const Dev diffs(out.bufs.size() * sizeof(BufferDiff));

  double flops = 0, k_sum = 0;
  int nonempty = 0;
  for (const GroupSpec& g : spec.groups) {
    const GroupProblem p = resolve_group(g, c.counts.data(), c.offsets.data());
    flops += 2.0 * double(p.m) * double(p.n) * double(p.k);
    if (p.m > 0) k_sum += double(p.k), ++nonempty;
  }
  auto make = [&](GemmSchedule s) {
    cuda::GemmLayout layout = spec.layout;
    layout.schedule = s;
    return std::make_unique<cuda::GroupedGemm>(spec.groups, layout, c.device);
  };
  auto run_into = [&](cuda::GroupedGemm& gemm, const cuda::BufferTable& table) {
    gemm.run(table, c.device_counts.as<int32_t>(), c.device_offsets.as<int32_t>(), c.s);
  };
  auto row_of = [&](const char* path, const Schedule& sc) {
    BenchRow row = cli::cuda_row(c.ns, path, c.device, 1, c.tokens, o.cases.iters);
    auto& e = row.extra;
    e["role"] = role.name;
    e["schedule"] = sc.name;
    e["tile"] = sc.tile;
    e["cluster"] = sc.cluster;
    e["layout"] = layout_name(spec.layout);
    e["layer_schedule"] = schedule_name(spec.layout.schedule);
    e["groups"] = spec.groups.size();
    e["nonempty_groups"] = nonempty;
    e["mean_group_k"] = nonempty > 0 ? k_sum / nonempty : 0.0;
    e["grouped_rows"] = int64_t(c.offsets.back());
    return row;
  };

  // The check. The cooperative reference, then the control (the cooperative kernel again, into the
  // other outputs: any difference is the harness's, not a schedule's), then each schedule.
  std::unique_ptr<cuda::GroupedGemm> coop = make(GemmSchedule::cooperative);
  out.fill_unwritten(out.ref, c.s);
  run_into(*coop, out.ref_table);
  std::vector<const Schedule*> candidates = {&kCooperative};
  candidates.insert(candidates.end(), schedules.begin(), schedules.end());
  std::vector<std::string> failed;
  std::vector<std::pair<const Schedule*, std::unique_ptr<cuda::GroupedGemm>>> timed;
  std::vector<std::string> checked;  // per timed kernel: how its check came out
  const std::string where = c.ns.name + " " + role.name;
  for (const Schedule* sc : candidates) {
    const bool control = sc == &kCooperative;
    const std::string what = std::string(role.name) + " " + sc->name + (control ? " (control)" : "");
    // A kernel that cannot be built or launched is reported on its check line, and the others
    // still run (an error that leaves the context unusable fails them too, each on its line).
    std::unique_ptr<cuda::GroupedGemm> gemm;
    Check k;
    std::string error;
    try {
      gemm = make(sc->schedule);
      out.fill_unwritten(out.test, c.s);
      run_into(*gemm, out.test_table);
      k = compare_outputs(c, spec, out, diffs, c.ns.name + " " + what);
    } catch (const Error& x) {
      error = x.what();
    }
    BenchRow row = row_of("grouped-gemm-check", *sc);
    if (error.empty()) row.max_rel_error = k.relative();
    auto& e = row.extra;
    if (!error.empty()) e["error"] = error;
    e["error_vs"] = "cooperative";
    e["check"] = control ? "control: the cooperative kernel twice, must be identical" : "against cooperative";
    e["identical"] = k.identical();
    const bool passed = error.empty() && (control ? k.identical() : k.passed());
    e["passed"] = passed;
    e["tolerance"] = control ? 0.0 : kTolerance;
    e["differing_elements"] = k.differing;
    e["unwritten_elements"] = k.unwritten;
    e["extra_elements"] = k.extra;
    e["non_finite_elements"] = k.non_finite;
    e["max_abs_diff"] = k.max_diff;
    e["max_abs_want"] = k.max_want;
    if (!k.first.empty()) e["first_difference"] = k.first;
    print_json_line(row);
    if (!passed) {
      failed.push_back(what);
      summary.push_back(c.ns.name + " " + what + ": CHECK FAILED, not timed: " +
                        (error.empty()
                             ? "max_rel_error " + std::to_string(k.relative()) + ", " + std::to_string(k.differing) +
                                   " elements differ (" + std::to_string(k.unwritten) + " unwritten); first " + k.first
                             : error));
      if (control) return failed;  // the comparison itself is broken: time nothing
    } else {
      timed.emplace_back(sc, std::move(gemm));
      checked.push_back(k.identical() ? "identical" : "max_rel_error " + std::to_string(k.relative()));
    }
  }

  // The times of every kernel that passed, in turn (into the reference outputs: checked already).
  std::vector<std::function<void()>> runs;
  for (auto& [sc, gemm] : timed) runs.push_back([&, g = gemm.get()] { run_into(*g, out.ref_table); });
  const Times t = time_in_turn(runs, o.cases.warmup, o.cases.iters, c.s);
  std::string line = where + " (k " + decimals(nonempty > 0 ? k_sum / nonempty : 0.0, 0) + ")";
  for (size_t j = 0; j < timed.size(); ++j) {
    const double tflops = flops / (t.ms[j] * 1e-3) / 1e12;
    BenchRow row = row_of("grouped-gemm", *timed[j].first);
    row.tflops = tflops;
    auto& e = row.extra;
    e["gemm_flops"] = flops;
    e["gemm_ms"] = t.ms[j];
    e["gemm_tflops"] = tflops;
    e["gemm_pct_peak"] = 100.0 * tflops / peak;
    e["dense_peak_tflops"] = peak;
    if (j > 0) e["speedup_vs_cooperative"] = 1.0 / t.ratio_to_first[j];  // 1 / median of the turns' time ratios
    e["times"] = "medians of runs in turn with the other schedules";
    cli::check_lab_row(row, c.ns.shape, c.tokens, 1);
    print_json_line(row);
    line += std::string(j == 0 ? ": " : "; ") + timed[j].first->name + " " + decimals(t.ms[j], 3) + " ms " +
            decimals(100.0 * tflops / peak, 1) + "% of peak" +
            (j > 0 ? " x" + decimals(1.0 / t.ratio_to_first[j], 3) + " (" + checked[j] + ")" : "");
  }
  summary.push_back(line);
  return failed;
}

std::vector<std::string> run_case(const NamedShape& ns, int64_t tokens, const Options& o) {
  const cli::CaseStream stream("gemm_schedules");
  const cudaStream_t s = stream.s;
  const MoeShape& sh = ns.shape;
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  const double peak = cli::dense_peak_tflops(s);

  // The routing and the single-GPU layer's schedule of it (tile_rows 1: segments back to back).
  const auto topk =
      core::sample_topk_ids({core::RoutingKind::uniform, 0.3, o.cases.seed}, tokens, sh.top_k, sh.num_experts);
  std::vector<float> weights(topk.size(), 1.0f);
  Dev ids(topk.size() * 4), route_weights(weights.size() * 4);
  ids.upload(topk.data());
  route_weights.upload(weights.data());
  const fixtures::GroupedSchedule sched(ids.as<int32_t>(), route_weights.as<float>(), sh, tokens, 1, s);
  std::vector<int32_t> counts(sh.num_experts), offsets(sh.num_experts + 1);
  MOKA_CUDA_CHECK(cudaMemcpyAsync(counts.data(), sched.counts.data(), counts.size() * 4, cudaMemcpyDeviceToHost, s));
  MOKA_CUDA_CHECK(cudaMemcpyAsync(offsets.data(), sched.offsets.data(), offsets.size() * 4, cudaMemcpyDeviceToHost, s));
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  int64_t routed = 0;
  for (int32_t n : counts) routed += n;
  require(routed == tokens * sh.top_k && offsets.back() == routed, ErrorCode::internal,
          "the grouped-row schedule does not hold every route once");

  // Every operand the chosen roles read, N(0, 1); outputs are each role's own.
  const LayerGemmSpecs specs = cuda::staged::layer_gemm_specs(sh, sh.num_experts, tokens);
  std::vector<const Role*> roles;
  for (const Role& r : kRoles)
    if (std::find(o.roles.begin(), o.roles.end(), r.name) != o.roles.end()) roles.push_back(&r);
  std::vector<const Schedule*> schedules;
  for (const Schedule& sc : kOthers)
    if (std::find(o.schedules.begin(), o.schedules.end(), sc.name) != o.schedules.end()) schedules.push_back(&sc);
  std::vector<int64_t> extent(cuda::staged::kNumBufs, 0), unused(cuda::staged::kNumBufs, 0);
  for (const Role* r : roles) extend_extents(specs.*r->spec, counts, offsets, extent, unused);
  std::vector<Dev> operands;
  cuda::BufferTable inputs;
  for (int b = 0; b < cuda::staged::kNumBufs; ++b) {
    operands.emplace_back(size_t(extent[b]) * 2);
    if (extent[b] > 0) operands.back().fill_normal(1.0, o.cases.seed + 100 + b);  // synchronizes the device
    inputs.ptr[b] = operands.back().data();
  }

  const Case c{ns, tokens, s, device, counts, offsets, sched.counts, sched.offsets, inputs};
  std::vector<std::string> failed;
  for (const Role* r : roles) {
    const std::vector<std::string> f = run_role(c, *r, specs.*r->spec, schedules, o, peak);
    for (const std::string& x : f) failed.push_back(ns.name + " " + x);
  }
  return failed;
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  Options o;
  o.cases.shapes = {"deepseek-v3", "gpt-oss-120b", "qwen3-30b-a3b"};
  CLI::App app{
      "The single-GPU layer's grouped GEMMs with every kernel schedule: checked against the cooperative "
      "kernel at full size, then timed (one GPU)",
      "gemm_schedules"};
  add_case_options(app, o.cases);
  app.add_option("--roles", o.roles, "The layer's grouped GEMMs to run (comma list)")
      ->delimiter(',')
      ->check(CLI::IsMember(names_of(kRoles)));
  app.add_option("--schedules", o.schedules, "The schedules to check and time against the cooperative one (comma list)")
      ->delimiter(',')
      ->check(CLI::IsMember(names_of(kOthers)));
  return lab_main(app, argc, argv, [&] {
    const SummaryAtExit print_summary;
    std::vector<moka::NamedShape> shapes;
    for (const std::string& name : o.cases.shapes) shapes.push_back(moka::named_shape(name));  // all, before any work
    std::vector<std::string> failed;
    for (const moka::NamedShape& ns : shapes)
      for (int64_t tokens : o.cases.tokens) {
        const std::vector<std::string> f = run_case(ns, tokens, o);
        failed.insert(failed.end(), f.begin(), f.end());
      }
    std::string list;
    for (const std::string& f : failed) list += (list.empty() ? "" : "; ") + f;
    moka::require(failed.empty(), moka::ErrorCode::internal,
                  "differs from the cooperative kernel (not timed; see its grouped-gemm-check line): " + list);
  });
}
