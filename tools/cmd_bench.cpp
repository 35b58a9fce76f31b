// `moka bench`: runs the layer forward+backward for named or custom shapes, checks it against
// the fp64 reference and reports times, TFLOP/s and error (table, or JSON lines with --json).
#include <chrono>
#include <fstream>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "bench_report.hpp"
#include "commands.hpp"
#include "core/routing_gen.hpp"
#include "cpu/layer_buffers.hpp"
#include "moka/moka.hpp"

namespace moka::cli {
namespace {

struct BenchOptions {
  std::vector<std::string> shapes;
  std::vector<int64_t> tokens;
  std::string backend = "auto";
  int ep = 1;
  int iters = 5;
  int warmup = 1;
  bool json = false;
  uint64_t seed = 1;
  std::string routing = "router";
  double gini = 0.3;
  std::string dump_routing;
  int threads = 0;
  int64_t tile_rows = 128;
  // A custom shape (used when --hidden is given).
  int64_t hidden = 0, intermediate = 0, experts = 0, top_k = 0, shared = 0;
  int fail_rank = -1;
};

NamedShape custom_shape(const BenchOptions& o) {
  NamedShape n = named_shape("tiny");
  n.name = "custom";
  n.shape = MoeShape{o.hidden, o.intermediate, o.experts, o.top_k, o.shared, Activation::swiglu, 7.0f};
  n.router.hidden = o.hidden;
  n.router.num_experts = o.experts;
  n.router.top_k = o.top_k;
  return n;
}

// Routing of one rank: through the model's router on random logits weights, or synthetic.
void make_routing(const NamedShape& ns, const BenchOptions& o, int rank, cpu::LayerBuffers<double>& b) {
  const auto& s = ns.shape;
  if (o.routing == "router") {
    RouterConfig rc = ns.router;
    rc.use_selection_bias = false;
    auto router = make_router(rc, Backend::cpu, LayerOptions{128, o.threads});
    std::vector<double> w_router(s.num_experts * s.hidden);
    std::mt19937_64 rng(o.seed * 31 + 7);  // the same router on every rank
    std::normal_distribution<double> nd(0.0, 1.0 / std::sqrt(double(s.hidden)));
    for (auto& v : w_router) v = nd(rng);
    RouterOutputs out{TensorView(b.topk_ids.data(), DType::i32, {b.tokens, s.top_k}),
                      TensorView(b.topk_weights.data(), DType::f64, {b.tokens, s.top_k}), {}};
    router->forward(TensorView(b.x.data(), DType::f64, {b.tokens, s.hidden}),
                    TensorView(w_router.data(), DType::f64, {s.num_experts, s.hidden}), {}, out);
    return;
  }
  core::RoutingSpec spec{core::parse_routing_kind(o.routing), o.gini, o.seed};
  b.topk_ids = core::sample_topk_ids(spec, b.tokens, s.top_k, s.num_experts, static_cast<uint64_t>(rank));
}

std::string cpu_device_name(int ep, int threads) {
  const unsigned hw = std::thread::hardware_concurrency();
  std::ostringstream os;
  os << "cpu (" << hw << " hardware threads";
  if (ep > 1) os << ", " << ep << " emulated ranks";
  if (threads > 0) os << ", " << threads << " threads per rank";
  os << ")";
  return os.str();
}

void dump_routing(const std::string& path, const NamedShape& ns, int64_t tokens, int ep,
                  const std::vector<std::vector<int32_t>>& ids) {
  nlohmann::ordered_json j;
  j["shape"] = ns.name;
  j["world_size"] = ep;
  j["tokens_per_rank"] = tokens;
  j["top_k"] = ns.shape.top_k;
  j["num_experts"] = ns.shape.num_experts;
  j["hidden"] = ns.shape.hidden;
  j["topk_ids"] = ids;
  std::ofstream f(path, std::ios::app);
  require(f.good(), ErrorCode::io, "cannot write routing dump " + path);
  f << j.dump() << "\n";
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

BenchRow run_cpu_case(const NamedShape& ns, int64_t tokens, const BenchOptions& o, Progress& progress) {
  const MoeShape& s = ns.shape;
  std::vector<double> fwd, bwd, total;
  std::vector<double> rank_error(o.ep, 0.0);
  std::vector<std::vector<int32_t>> all_ids(o.ep);
  const LayerOptions lo{o.tile_rows, o.threads};
  run_emulated_ranks(o.ep, [&](ProcessGroup& g) {
    const int rank = g.rank();
    cpu::LayerBuffers<double> ref(s, o.ep, tokens);
    ref.randomize(o.seed * 1000 + rank);
    make_routing(ns, o, rank, ref);
    if (rank == o.fail_rank) ref.topk_ids.at(0) = static_cast<int32_t>(s.num_experts);  // --fail-rank
    all_ids[rank] = ref.topk_ids;
    auto f32 = cpu::convert_buffers<float>(ref);
    auto layer = make_moe_layer(s, Backend::cpu, &g, lo);
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      if (rank == 0) progress.update(ns.name + " T=" + std::to_string(tokens), it + 1, o.warmup + o.iters);
      g.barrier();
      const auto t0 = Clock::now();
      auto ctx = layer->forward(f32.inputs(), f32.weights(), f32.out_view());
      g.barrier();
      const double tf = ms_since(t0);
      const auto t1 = Clock::now();
      layer->backward(*ctx, f32.d_out_view(), f32.weights(), f32.gradients());
      g.barrier();
      const double tb = ms_since(t1);
      if (rank == 0 && it >= o.warmup) {
        fwd.push_back(tf);
        bwd.push_back(tb);
        total.push_back(tf + tb);
      }
    }
    auto ctx = layer->forward(ref.inputs(), ref.weights(), ref.out_view());
    layer->backward(*ctx, ref.d_out_view(), ref.weights(), ref.gradients());
    rank_error[rank] = cpu::max_layer_error(f32, ref);
  });
  if (!o.dump_routing.empty()) dump_routing(o.dump_routing, ns, tokens, o.ep, all_ids);
  BenchRow row;
  row.shape = ns.name;
  row.backend = "cpu";
  row.path = "reference";
  row.device = cpu_device_name(o.ep, o.threads);
  row.dtype = "f32";
  row.routing = o.routing == "zipf" ? "zipf(gini=" + std::to_string(o.gini).substr(0, 4) + ")" : o.routing;
  row.ep = o.ep;
  row.tokens_per_rank = tokens;
  row.iters = o.iters;
  row.fwd_ms = median(fwd);
  row.bwd_ms = median(bwd);
  row.fwdbwd_ms = median(total);
  row.tflops = 3.0 * s.forward_flops(tokens) / (row.fwdbwd_ms * 1e-3) / 1e12;
  row.max_rel_error = *std::max_element(rank_error.begin(), rank_error.end());
  return row;
}

void run_bench(BenchOptions o) {
  const Backend backend = [&] {
    const Backend b = parse_backend(o.backend);
    if (b != Backend::automatic) return b;
    return cuda_backend_available() ? Backend::cuda : Backend::cpu;
  }();
  require(backend == Backend::cpu, ErrorCode::backend_unavailable,
          "moka bench --backend cuda needs the CUDA backend, which this build does not have yet");
  require(o.ep >= 1, ErrorCode::invalid_argument, "--ep must be >= 1");
  require(o.iters >= 1 && o.warmup >= 0, ErrorCode::invalid_argument, "--iters must be >= 1, --warmup >= 0");
  std::vector<NamedShape> shapes;
  if (o.hidden > 0) {
    shapes.push_back(custom_shape(o));
  } else {
    if (o.shapes.empty()) o.shapes = {"tiny"};
    for (const auto& name : o.shapes) shapes.push_back(named_shape(name));
  }
  if (o.tokens.empty()) o.tokens = {512};
  Progress progress("moka bench");
  std::vector<BenchRow> rows;
  for (const auto& ns : shapes) {
    for (int64_t t : o.tokens) {
      rows.push_back(run_cpu_case(ns, t, o, progress));
      if (o.json) std::cout << bench_json(rows.back()) << std::endl;
    }
  }
  progress.finish();
  if (!o.json) print_table(std::cout, rows);
}

}  // namespace

void register_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  auto* cmd = app.add_subcommand("bench", "Run the MoE layer forward+backward, check and time it");
  cmd->add_option("--shape", o->shapes, "Named shape(s): qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, "
                                        "gpt-oss-120b, mixtral-8x7b, tiny")->delimiter(',');
  cmd->add_option("--tokens", o->tokens, "Tokens per rank (comma list)")->delimiter(',');
  cmd->add_option("--backend", o->backend, "cpu | cuda | auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->add_option("--ep", o->ep, "Expert-parallel ranks (emulated as threads on the CPU backend)");
  cmd->add_option("--iters", o->iters, "Timed iterations (median reported)");
  cmd->add_option("--warmup", o->warmup, "Untimed warm-up iterations");
  cmd->add_flag("--json", o->json, "One JSON line per case");
  cmd->add_option("--seed", o->seed, "Random seed");
  cmd->add_option("--routing", o->routing, "router | uniform | zipf | one-expert")
      ->check(CLI::IsMember({"router", "uniform", "zipf", "one-expert"}));
  cmd->add_option("--gini", o->gini, "Target per-expert load Gini for --routing zipf");
  cmd->add_option("--dump-routing", o->dump_routing, "Append the routing of every case to FILE (JSON lines)");
  cmd->add_option("--threads", o->threads, "CPU threads per rank (0 = all cores / ranks)");
  cmd->add_option("--tile-rows", o->tile_rows, "Rows each expert is padded to");
  cmd->add_option("--hidden", o->hidden, "Custom shape: hidden size");
  cmd->add_option("--intermediate", o->intermediate, "Custom shape: expert intermediate size");
  cmd->add_option("--experts", o->experts, "Custom shape: number of experts");
  cmd->add_option("--topk", o->top_k, "Custom shape: experts per token");
  cmd->add_option("--shared-intermediate", o->shared, "Custom shape: shared expert size (0 = none)");
  cmd->add_option("--fail-rank", o->fail_rank, "Make this rank fail with a bad input (to test error propagation)");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace moka::cli
