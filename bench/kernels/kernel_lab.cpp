#include "kernel_lab.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <random>

#include "core/activation.hpp"
#include "core/routing_gen.hpp"
#include "core/schedule.hpp"
#include "cuda/common/check.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "moka/distributed.hpp"
#include "moka/error.hpp"

namespace moka::lab {

void add_case_options(CLI::App& app, CaseOptions& o) {
  app.add_option("--shape", o.shapes,
                 "Named shape(s): qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, gpt-oss-120b, "
                 "mixtral-8x7b, tiny")
      ->delimiter(',');
  app.add_option("--tokens", o.tokens, "Tokens per rank (comma list)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--iters", o.iters, "Timed iterations (median reported)")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", o.warmup, "Untimed warm-up iterations")->check(CLI::Range(0, 1000000));
  app.add_option("--seed", o.seed, "Random seed");
}

void add_megakernel_options(CLI::App& app, MegakernelConfig& c) {
  app.add_option("--comm-sms", c.num_comm_sms, "Megakernel: communication CTAs")->check(CLI::Range(1, 1024));
  app.add_option("--minibatch", c.minibatch_size, "Megakernel: minibatch rows")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--macrobatch", c.macrobatch_size, "Megakernel: ring-buffer rows")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--band-rows", c.band_row_tiles, "Megakernel: row tiles per band of the GEMM tile order")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
}

void print_json_line(const BenchRow& row) { std::cout << cli::bench_json(row) << std::endl; }

namespace {
constexpr int64_t kTileRows = 128;  // the megakernel's, and the schedule's padding
}  // namespace

int lab_main(CLI::App& app, int argc, char** argv, const std::function<void()>& run) {
  for (CLI::Option* option : app.get_options()) option->capture_default_str();  // --help shows the defaults
  const std::string name = app.get_name();
  try {
    app.parse(argc, argv);
    run();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const Error& e) {
    std::cerr << name + ": " + e.what() + "\n";  // one write: worker processes share stderr
    return 2;
  } catch (const std::exception& e) {
    std::cerr << name + ": " + e.what() + "\n";
    return 3;
  }
  return 0;
}

int case_bench_main(CLI::App& app, int argc, char** argv, CaseOptions& cases, MegakernelConfig* megakernel,
                    const RunCase& run_case) {
  add_case_options(app, cases);
  if (megakernel) add_megakernel_options(app, *megakernel);
  return lab_main(app, argc, argv, [&] {
    for (const std::string& name : cases.shapes)
      for (int64_t tokens : cases.tokens) {
        const NamedShape ns = named_shape(name);
        const BenchRow row = run_case(ns, tokens);
        cli::check_lab_row(row, ns.shape, tokens, kTileRows);  // impossible rows are refused, not printed
        print_json_line(row);
      }
  });
}

std::unique_ptr<ProcessGroup> join_workers() {
  if (!launched_as_worker()) return nullptr;
  const Rendezvous rv = rendezvous_from_env();
  MOKA_CUDA_CHECK(cudaSetDevice(rv.local_rank));
  return make_tcp_group(rv);
}

cuda::GroupSpec expert_rows_group(int e, int a, int64_t lda, int b, int64_t b_off, int64_t ldb, int d, int64_t ldd,
                                  int64_t n, int64_t k) {
  cuda::GroupSpec g;
  g.a = a, g.a_step = lda, g.lda = lda;
  g.b = b, g.b_off = b_off, g.ldb = ldb;
  g.d = d, g.d_step = ldd, g.ldd = ldd;
  g.n = int(n), g.k = int(k), g.expert = e, g.count_dim = cuda::CountDim::m;
  return g;
}

namespace {

template <typename T>
Dev device_copy(const std::vector<T>& host) {
  Dev d(host.size() * sizeof(T));
  d.upload(host.data());  // in place on return: the schedule reads it on a non-blocking stream
  return d;
}

template <typename T>
std::vector<T> host_copy(const Dev& d, size_t count) {
  std::vector<T> h(count);
  MOKA_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

std::vector<float> uniform_weights(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> w01(0.f, 1.f);
  std::vector<float> w(count);
  for (float& v : w) v = w01(rng);
  return w;
}

}  // namespace

GroupedRowsCase::GroupedRowsCase(const MoeShape& sh, int64_t t, int64_t rows, uint64_t seed, cudaStream_t s)
    : shape(sh), tokens(t),
      topk(core::sample_topk_ids({core::RoutingKind::uniform, 0, seed}, t, sh.top_k, sh.num_experts)),
      x(t * sh.hidden * 2), d_out(x.bytes()), ids(device_copy(topk)),
      route_weights(device_copy(uniform_weights(topk.size(), seed + 1))),
      wg(sh.num_experts * sh.intermediate * sh.hidden * 2), wu(wg.bytes()), wd(wg.bytes()),
      sched(ids.as<int32_t>(), route_weights.as<float>(), sh, t, kTileRows, s), grouped(rows * sh.hidden * 2) {
  require(rows >= sched.rows, ErrorCode::internal, "the megakernel core holds fewer rows than the schedule");
  std::mt19937_64 rng(seed);
  x.fill_normal(1.0, rng());
  d_out.fill_normal(1.0, rng());
  wg.fill_normal(1 / std::sqrt(double(sh.hidden)), rng());
  wu.fill_normal(1 / std::sqrt(double(sh.hidden)), rng());
  wd.fill_normal(1 / std::sqrt(double(sh.intermediate)), rng());
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());  // the fills ran on the legacy stream, the gather runs on s
  // The schedule as the routing says: each expert's routes counted, its segment padded to whole tiles.
  std::vector<int32_t> routed(sh.num_experts, 0);
  for (int32_t e : topk) ++routed[e];
  const std::vector<int32_t> got = counts(), starts = offsets();
  for (int64_t e = 0, start = 0; e <= sh.num_experts; ++e) {
    require(starts[e] == start && (e == sh.num_experts || got[e] == routed[e]), ErrorCode::internal,
            "the grouped-row schedule does not match the routing at expert " + std::to_string(e) + " (" +
                std::to_string(t) + " tokens of " + std::to_string(sh.num_experts) + " experts)");
    if (e < sh.num_experts) start += core::round_up(int64_t(routed[e]), kTileRows);
  }
  cuda::gather_rows(x.as<cuda::bf16>(), grouped.as<cuda::bf16>(), sched.row_of_slot.as<int32_t>(), t * sh.top_k,
                    sh.top_k, sh.hidden, s);
}

std::vector<int32_t> GroupedRowsCase::counts() const { return host_copy<int32_t>(sched.counts, shape.num_experts); }
std::vector<int32_t> GroupedRowsCase::offsets() const {
  return host_copy<int32_t>(sched.offsets, shape.num_experts + 1);
}

namespace {

// `count` bf16 values at element `offset` of a device buffer, as doubles.
std::vector<double> host_values(const Dev& d, int64_t offset, int64_t count) {
  std::vector<__nv_bfloat16> raw(count);
  MOKA_CUDA_CHECK(cudaMemcpy(raw.data(), d.as<__nv_bfloat16>() + offset, count * 2, cudaMemcpyDeviceToHost));
  std::vector<double> values(count);
  std::transform(raw.begin(), raw.end(), values.begin(), [](__nv_bfloat16 v) { return __bfloat162float(v); });
  return values;
}

// out[i] = sum_k v[k] * w[i * width + k]
std::vector<double> matvec(const std::vector<double>& w, const std::vector<double>& v) {
  const size_t width = v.size();
  std::vector<double> out(w.size() / width);
  for (size_t i = 0; i < out.size(); ++i)
    for (size_t k = 0; k < width; ++k) out[i] += v[k] * w[i * width + k];
  return out;
}

// Running max |got - want| and max |want| of one output.
struct Difference {
  double diff = 0, scale = 0;
  void add(const std::vector<double>& got, const std::vector<double>& want) {
    for (size_t i = 0; i < want.size(); ++i) {
      diff = std::max(diff, std::isfinite(got[i]) ? std::abs(got[i] - want[i]) : INFINITY);
      scale = std::max(scale, std::abs(want[i]));
    }
  }
  double relative() const { return scale > 0 ? diff / scale : diff; }
};

constexpr int kSampledExperts = 4, kSampledRowsPerExpert = 4;

}  // namespace

double routed_rows_cpu_error(const GroupedRowsCase& in, const Dev& hidden, const Dev& y) {
  const MoeShape& sh = in.shape;
  const int64_t H = sh.hidden, I = sh.intermediate;
  const core::ActParams act = core::ActParams::of(sh);
  const std::vector<int32_t> counts = in.counts(), offsets = in.offsets();
  Difference h_diff, y_diff;
  for (int pick = 0; pick < kSampledExperts; ++pick) {
    const int64_t e = pick * sh.num_experts / kSampledExperts;
    const int64_t rows = std::min<int64_t>(counts[e], kSampledRowsPerExpert);
    if (rows == 0) continue;
    const auto w_gate = host_values(in.wg, e * I * H, I * H), w_up = host_values(in.wu, e * I * H, I * H);
    const auto w_down = host_values(in.wd, e * H * I, H * I);
    for (int64_t r = offsets[e]; r < offsets[e] + rows; ++r) {
      const auto x = host_values(in.grouped, r * H, H);
      const auto g = matvec(w_gate, x), u = matvec(w_up, x);
      std::vector<double> h(I);
      for (int64_t i = 0; i < I; ++i) h[i] = core::swiglu_forward(g[i], u[i], act.clamped, double(act.limit));
      const auto device_h = host_values(hidden, r * I, I);
      h_diff.add(device_h, h);
      y_diff.add(host_values(y, r * H, H), matvec(w_down, device_h));
    }
  }
  return std::max(h_diff.relative(), y_diff.relative());
}

}  // namespace moka::lab
