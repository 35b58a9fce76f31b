// `moka bench`: runs the layer forward+backward for named or custom shapes, checks it against
// the fp64 reference and reports times, TFLOP/s and error (table, or JSON lines with --json).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "bench_cuda.hpp"
#include "bench_report.hpp"
#include "commands.hpp"
#include "core/routing_gen.hpp"
#include "cpu/parallel.hpp"
#include "layer_buffers.hpp"
#include "moka/distributed.hpp"
#include "moka/moka.hpp"
#include "option_checks.hpp"

namespace moka::cli {
namespace {

struct BenchOptions {
  std::vector<std::string> shapes = {"tiny"};
  std::vector<int64_t> tokens = {512};
  std::string backend = "auto";
  int ep = 1;
  int iters = 5;
  int warmup = 1;
  bool json = false;
  uint64_t seed = 1;
  std::string routing = "router";
  double gini = 0.3;
  std::string dump_routing;
  std::string torch_results;
  int threads = 0;
  int64_t tile_rows = 128;
  // A custom shape (used when --hidden is given).
  int64_t hidden = 0, intermediate = 0, experts = 0, top_k = 0, shared = 0;
  int fail_rank = -1;
  std::string fail_mode = "bad-input";
  MegakernelConfig megakernel;  // CUDA layer runs also time the megakernel path
  std::string context = "auto";
  bool no_baselines = false;
  bool breakdown = false;
  std::string save = "gate_up";
  std::string precision = "bf16";
  int depth = 1;
  std::string row_order = "rate-based";
  std::string timeline;
  int gpus = 1;
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
void make_routing(const NamedShape& ns, const BenchOptions& o, int rank, LayerBuffers<double>& b) {
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
                      TensorView(b.topk_weights.data(), DType::f64, {b.tokens, s.top_k}),
                      {}};
    router->forward(TensorView(b.x.data(), DType::f64, {b.tokens, s.hidden}),
                    TensorView(w_router.data(), DType::f64, {s.num_experts, s.hidden}), {}, out, Stream{});
    return;
  }
  core::RoutingSpec spec{core::parse_routing_kind(o.routing), o.gini, o.seed};
  b.topk_ids = core::sample_topk_ids(spec, b.tokens, s.top_k, s.num_experts, static_cast<uint64_t>(rank));
}

std::string cpu_device_name(int ranks, int threads, bool processes) {
  const unsigned hw = std::thread::hardware_concurrency();
  std::ostringstream os;
  os << "cpu (" << hw << " hardware threads";
  if (ranks > 1) os << ", " << ranks << (processes ? " worker processes" : " emulated ranks");
  if (threads > 0) os << ", " << threads << " threads per rank";
  os << ")";
  return os.str();
}

// --fail-rank: this rank fails right after start, as a bad input (caught by validation on every
// rank), as a crash (SIGABRT) or a kill (SIGKILL, as the OOM killer sends it) after which
// peers see its connection close, or as a stall (the process stops itself; peers time out
// naming it; for worker processes only).
void fail_on_purpose(const std::string& mode, LayerBuffers<double>& b, const MoeShape& s) {
  if (mode == "crash") std::abort();
  if (mode == "kill") std::raise(SIGKILL);
  if (mode == "stall") std::raise(SIGSTOP);
  b.topk_ids.at(0) = static_cast<int32_t>(s.num_experts);
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// The CPU reference's dense rate on this machine, now: a 256^3 f32 product in the form of its
// fastest row loop (the weight gradients' acc[i] += d * row[i], which the compiler vectorizes; the
// forward's dot products do not) on `threads` threads, best of five runs, measured once per
// thread count. The FLOP ceiling of the CPU rows' floor.
double cpu_dense_peak_tflops(int threads) {
  static std::map<int, double> measured;  // called by rank 0 only
  if (auto it = measured.find(threads); it != measured.end()) return it->second;
  const int64_t n = 256;
  std::vector<float> a(n * n), b(n * n), c(n * n);
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto* v : {&a, &b})
    for (float& x : *v) x = u(rng);
  double best = 0;
  for (int run = 0; run < 5; ++run) {
    const auto t0 = Clock::now();
    cpu::parallel_for(n, threads, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* acc = &c[r * n];
        std::fill(acc, acc + n, 0.f);
        for (int64_t q = 0; q < n; ++q) {
          const float d = a[r * n + q];
          const float* row = &b[q * n];
          for (int64_t i = 0; i < n; ++i) acc[i] += d * row[i];
        }
      }
    });
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n / seconds / 1e12);
  }
  return measured[threads] = best;
}

// One rank's part of a case, collective over `g` (threads of one process or worker processes).
// Rank 0 returns the row.
std::optional<BenchRow> run_cpu_case_on(ProcessGroup& g, const NamedShape& ns, int64_t tokens, const BenchOptions& o,
                                        Progress& progress) {
  const MoeShape& s = ns.shape;
  const int rank = g.rank(), world = g.size();
  std::vector<double> fwd, bwd, total;
  LayerBuffers<double> ref(s, world, tokens);
  ref.randomize(o.seed * 1000 + rank);
  make_routing(ns, o, rank, ref);
  if (rank == o.fail_rank) fail_on_purpose(o.fail_mode, ref, s);
  auto f32 = convert_buffers<float>(ref);
  LayerOptions options{o.tile_rows, o.threads};
  options.precision = parse_precision(o.precision);
  auto layer = make_moe_layer(s, Backend::cpu, &g, options);
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    if (rank == 0) progress.update(ns.name + " T=" + std::to_string(tokens), it + 1, o.warmup + o.iters);
    g.barrier();
    const auto t0 = Clock::now();
    auto ctx = layer->forward(f32.inputs(), f32.weights(), f32.out_view(), Stream{});
    g.barrier();
    const double tf = ms_since(t0);
    const auto t1 = Clock::now();
    layer->backward(*ctx, f32.d_out_view(), f32.weights(), f32.gradients(), Stream{});
    g.barrier();
    const double tb = ms_since(t1);
    if (it >= o.warmup) {
      fwd.push_back(tf);
      bwd.push_back(tb);
      total.push_back(tf + tb);
    }
  }
  // The f64 reference is the exact layer: with --precision fp8 the row's error is the recipe's.
  auto exact = make_moe_layer(s, Backend::cpu, &g, LayerOptions{o.tile_rows, o.threads});
  auto ctx = exact->forward(ref.inputs(), ref.weights(), ref.out_view(), Stream{});
  exact->backward(*ctx, ref.d_out_view(), ref.weights(), ref.gradients(), Stream{});
  const double error = max_layer_error(f32, ref);
  std::vector<double> errors(world);
  g.all_gather(&error, errors.data(), sizeof(double));
  std::vector<int32_t> ids(world * ref.topk_ids.size());
  g.all_gather(ref.topk_ids.data(), ids.data(), ref.topk_ids.size() * sizeof(int32_t));
  if (rank != 0) return std::nullopt;

  std::vector<std::vector<int32_t>> per_rank(world);
  std::vector<int64_t> routes;  // the route matrix, routes[s * world + r]
  for (int r = 0; r < world; ++r) {
    per_rank[r].assign(ids.begin() + r * ref.topk_ids.size(), ids.begin() + (r + 1) * ref.topk_ids.size());
    const auto from_r = routes_per_rank(per_rank[r], s.num_experts / world, world);
    routes.insert(routes.end(), from_r.begin(), from_r.end());
  }
  if (!o.dump_routing.empty()) dump_routing(o.dump_routing, ns, tokens, world, per_rank);
  BenchRow row;
  row.shape = ns.name;
  row.backend = "cpu";
  row.path = "reference";
  row.device = cpu_device_name(world, o.threads, o.gpus > 1);
  row.dtype = options.precision == Precision::fp8 ? "fp8" : "f32";
  row.routing = o.routing == "zipf" ? "zipf(gini=" + std::to_string(o.gini).substr(0, 4) + ")" : o.routing;
  row.ep = world;
  row.tokens_per_rank = tokens;
  row.iters = o.iters;
  row.fwd_ms = median(fwd);
  row.bwd_ms = median(bwd);
  row.fwdbwd_ms = median(total);
  row.tflops = 3.0 * s.forward_flops(tokens) / (row.fwdbwd_ms * 1e-3) / 1e12;
  row.max_rel_error = *std::max_element(errors.begin(), errors.end());
  // The floor counts FLOPs only: emulated ranks and worker processes share this machine's
  // memory, with no link to bound them. Memory stays null: the CPU layers' buffers are host
  // vectors nothing accounts for (docs/PERFORMANCE.md).
  const double peak = cpu_dense_peak_tflops(cpu::resolve_threads(o.threads, world));
  set_floor(row, layer_floor(s, tokens, routes, world, peak, std::nullopt), peak);
  set_torch(row, torch_result(o.torch_results, ns.name, tokens, world));
  return row;
}

// A case on the worker processes' group, or on `ep` emulated ranks of this process.
std::optional<BenchRow> run_cpu_case(ProcessGroup* workers, const NamedShape& ns, int64_t tokens, const BenchOptions& o,
                                     Progress& progress) {
  if (workers) return run_cpu_case_on(*workers, ns, tokens, o, progress);
  std::optional<BenchRow> row;
  run_emulated_ranks(o.ep, [&](ProcessGroup& g) {
    auto r = run_cpu_case_on(g, ns, tokens, o, progress);
    if (g.rank() == 0) row = r;
  });
  return row;
}

CudaBenchOptions cuda_options(const BenchOptions& o, const std::string& timeline) {
  CudaBenchOptions co;
  co.iters = o.iters;
  co.warmup = o.warmup;
  co.seed = o.seed;
  co.tile_rows = o.tile_rows;
  co.torch_results = o.torch_results;
  co.megakernel = o.megakernel;
  co.megakernel.row_order = o.row_order == "round-robin" ? RowOrder::round_robin : RowOrder::rate_based;
  co.context = o.context;
  co.baselines = !o.no_baselines;
  co.save = parse_save_mode(o.save);
  co.depth = o.depth;
  co.breakdown = o.breakdown;
  co.timeline = timeline;
  co.routing = o.routing == "router" ? "uniform" : o.routing;  // CUDA cases sample their routing
  co.dump_routing = o.dump_routing;
  co.gini = o.gini;
  return co;
}

// Host memory of one case's reference buffers (LayerBuffers in fp64 and their f32 copy)
// over `world` ranks; the layers' workspaces come on top.
// Host bytes of one CPU-backend case over `world` emulated ranks: the tokens' tensors, weights
// and gradients (f64 and f32 copies), and each rank's grouped rows at the backward's peak (x,
// y, d_out and dx rows H wide, gate, up, hidden, dG and dU I wide), every expert's rows padded
// to `tile_rows`.
double reference_buffer_bytes(const MoeShape& s, int world, int64_t tokens, int64_t tile_rows) {
  const double T = double(tokens), H = double(s.hidden), I = double(s.intermediate), k = double(s.top_k);
  const double local_experts = double(s.num_experts) / world;
  const double grouped_rows = T * k + local_experts * double(tile_rows - 1);
  const double values = 4 * T * H + 2 * T * k + 6 * local_experts * I * H + 6 * double(s.shared_intermediate) * H +
                        grouped_rows * (4 * H + 5 * I);
  return world * (values * (sizeof(double) + sizeof(float)) + 2 * T * k * sizeof(int32_t));
}

// Checks that need the shapes, before any rank, thread or buffer exists. Only the CPU backend
// holds full host copies of every case (the CUDA bench keeps its tensors on the device).
void validate_cases(const BenchOptions& o, const std::vector<NamedShape>& shapes, Backend backend) {
  const bool processes = o.gpus > 1;
  const int world = processes ? o.gpus : o.ep;
  const std::string ranks_option = (processes ? "--gpus " : "--ep ") + std::to_string(world);
  require(!processes || o.ep == 1, ErrorCode::invalid_argument, "--ep (emulated ranks) cannot be combined with --gpus");
  if (!o.dump_routing.empty()) check_output_path("--dump-routing", o.dump_routing);
  if (!o.timeline.empty()) check_output_path("--timeline", o.timeline);
  for (const auto& ns : shapes) {
    const MoeShape& s = ns.shape;
    require(s.num_experts % world == 0, ErrorCode::invalid_argument,
            ranks_option + " does not divide the " + std::to_string(s.num_experts) + " experts of " + ns.name);
    require(s.top_k <= s.num_experts, ErrorCode::invalid_argument,
            "--top-k " + std::to_string(s.top_k) + " exceeds --experts " + std::to_string(s.num_experts));
    if (backend != Backend::cpu) continue;
    for (int64_t t : o.tokens)
      require_host_memory(reference_buffer_bytes(s, world, t, o.tile_rows),
                          "--tokens " + std::to_string(t) + " with --tile-rows " + std::to_string(o.tile_rows),
                          "the reference buffers of " + ns.name + " over " + std::to_string(world) + " ranks");
  }
}

// What `--backend auto` picks, and why in words for a note on stderr.
std::pair<Backend, std::string> automatic_backend(Precision precision) {
  if (precision == Precision::fp8) return {Backend::cpu, "cpu (--precision fp8 is the CPU backend's emulation)"};
  if (cuda_backend_available()) return {Backend::cuda, "cuda (a GPU is visible)"};
#if MOKA_HAVE_CUDA
  return {Backend::cpu, "cpu (no GPU visible)"};
#else
  return {Backend::cpu, "cpu (this build has no CUDA backend)"};
#endif
}

void run_bench(const BenchOptions& o) {
  std::vector<NamedShape> shapes;
  if (o.hidden > 0) {
    shapes.push_back(custom_shape(o));
  } else {
    for (const auto& name : o.shapes) shapes.push_back(named_shape(name));
  }
  const bool automatic = parse_backend(o.backend) == Backend::automatic;
  const auto [backend, backend_choice] = automatic ? automatic_backend(parse_precision(o.precision))
                                                   : std::pair<Backend, std::string>{parse_backend(o.backend), ""};
  require(backend == Backend::cpu || o.precision == "bf16", ErrorCode::invalid_argument,
          "--precision fp8 runs on the CPU backend (the FP8 recipe's emulation) until the CUDA backend has FP8 "
          "kernels: use --backend cpu");
  validate_cases(o, shapes, backend);
  require(!o.breakdown || backend == Backend::cuda, ErrorCode::invalid_argument,
          "--breakdown times the CUDA layer's stages: it takes --backend cuda (or auto with a GPU visible)");
  if (ran_as_workers(o.gpus, "bench")) return;
  // Worker processes (started by --gpus N or `moka launch`) form one group over TCP.
  std::unique_ptr<ProcessGroup> workers = join_workers(backend == Backend::cuda);
  const bool root = !workers || workers->rank() == 0;
  require(!workers || o.ep == 1, ErrorCode::invalid_argument,
          "--ep (emulated ranks) cannot be combined with worker processes");
  const int world = workers ? workers->size() : o.ep;
  require(o.fail_rank < world, ErrorCode::invalid_argument,
          "--fail-rank " + std::to_string(o.fail_rank) + " is not one of the " + std::to_string(world) + " ranks");
  if (automatic && root) std::cerr << "moka bench: backend auto -> " << backend_choice << "\n";
  Progress progress("moka bench");
  std::vector<BenchRow> rows;
  try {
    for (const auto& ns : shapes) {
      for (int64_t t : o.tokens) {
        // Only the first case records a timeline (on every rank: the call is collective).
        const bool first_case = &ns == &shapes.front() && t == o.tokens.front();
        const CudaBenchOptions co = cuda_options(o, first_case ? o.timeline : std::string());
        std::vector<BenchRow> case_rows;
        if (backend == Backend::cuda) {
          if (root) progress.update(ns.name + " T=" + std::to_string(t), 1, 1);
          case_rows = workers ? run_cuda_ep_case(*workers, ns, t, co) : run_cuda_case(ns, t, co);
        } else if (auto row = run_cpu_case(workers.get(), ns, t, o, progress)) {
          case_rows.push_back(*row);
        }
        for (const BenchRow& row : case_rows) {
          if (o.json) std::cout << bench_json(row) << std::endl;
          rows.push_back(row);
        }
      }
    }
  } catch (const std::exception& e) {
    if (workers) workers->abort(e.what());  // peers stop with this reason instead of waiting
    throw;
  }
  progress.finish();
  if (o.json || !root) return;
  print_table(std::cout, rows);
  std::cout << "\n";
  print_floor_comparison(std::cout, rows);
  std::vector<BenchRow> staged;  // the megakernel rows have none of the comparison's columns
  std::copy_if(rows.begin(), rows.end(), std::back_inserter(staged),
               [](const BenchRow& r) { return r.path != "megakernel"; });
  if (backend == Backend::cuda) print_cuda_comparison(std::cout, staged);
  if (o.breakdown) print_stage_breakdown(std::cout, rows);
}

}  // namespace

void register_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  auto* cmd = app.add_subcommand("bench", "Run the MoE layer forward+backward, check and time it");
  auto* shape = cmd->add_option("--shape", o->shapes,
                                "Named shape(s): qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, "
                                "gpt-oss-120b, mixtral-8x7b, tiny")
                    ->delimiter(',');
  cmd->add_option("--tokens", o->tokens, "Tokens per rank (comma list)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--backend", o->backend, "cpu | cuda | auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->add_option("--precision", o->precision,
                  "The experts' GEMMs: bf16 (the tensors' own dtype; f32 on the CPU backend) | fp8 (DeepSeek-V3's "
                  "e4m3 recipe, emulated on the CPU backend; max_rel_error against the exact layer)")
      ->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--ep", o->ep, "Expert-parallel ranks (emulated as threads on the CPU backend)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--iters", o->iters, "Timed iterations (median reported)")->check(CLI::Range(1, 1000000));
  cmd->add_option("--warmup", o->warmup, "Untimed warm-up iterations")->check(CLI::Range(0, 1000000));
  cmd->add_flag("--json", o->json, "One JSON line per case");
  cmd->add_option("--seed", o->seed, "Random seed");
  cmd->add_option("--routing", o->routing,
                  "router | uniform | zipf | one-expert | one-rank (CUDA expert parallelism: rank 0's experts only)")
      ->check(CLI::IsMember({"router", "uniform", "zipf", "one-expert", "one-rank"}));
  cmd->add_option("--gini", o->gini, "Target per-expert load Gini for --routing zipf")->check(gini_range());
  cmd->add_option("--dump-routing", o->dump_routing, "Append the routing of every case to FILE (JSON lines)");
  cmd->add_option("--threads", o->threads, "CPU threads per rank (0 = all cores / ranks)")->check(CLI::Range(0, 4096));
  cmd->add_option("--tile-rows", o->tile_rows, "Rows each expert is padded to")->check(CLI::Range(1, 1 << 16));
  const auto custom = [&](const char* name, int64_t& value, const char* help, int64_t min) {
    return cmd->add_option(name, value, help)->check(CLI::Range(min, int64_t{1} << 24));
  };
  auto* hidden = custom("--hidden", o->hidden, "Custom shape: hidden size", 1)->excludes(shape);
  for (CLI::Option* option : {custom("--intermediate", o->intermediate, "Custom shape: expert intermediate size", 1),
                              custom("--experts", o->experts, "Custom shape: number of experts", 1),
                              custom("--top-k", o->top_k, "Custom shape: experts per token", 1)}) {
    hidden->needs(option);
    option->needs(hidden);
  }
  custom("--shared-intermediate", o->shared, "Custom shape: shared expert size (0 = none)", 0)->needs(hidden);
  cmd->add_option("--torch-results", o->torch_results,
                  "JSON lines of bench/torch_baseline.py (same shapes, same run) to print speedups against")
      ->check(CLI::ExistingFile);
  // Fault injection for the error-propagation tests: options without a group, which --help
  // leaves out.
  cmd->add_option("--fail-rank", o->fail_rank, "Make this rank fail (to test error propagation)")
      ->check(CLI::Range(-1, 4095))
      ->group("");
  cmd->add_option("--fail-mode", o->fail_mode, "bad-input | crash | kill | stall")
      ->check(CLI::IsMember({"bad-input", "crash", "kill", "stall"}))
      ->group("");
  cmd->add_option("--gpus", o->gpus, "Worker processes, one per GPU (started by moka itself)")->check(CLI::Range(1, 64));
  cmd->add_option("--comm-sms", o->megakernel.num_comm_sms, "Megakernel: communication CTAs (EP CUDA runs)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--minibatch", o->megakernel.minibatch_size, "Megakernel: minibatch rows")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--macrobatch", o->megakernel.macrobatch_size,
                  "Megakernel: ring-buffer rows (one GPU: the backward keeps the forward's rows, resident context, "
                  "when the ring holds every routed row, else replays them; the row's context_mode says which)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--band-rows", o->megakernel.band_row_tiles,
                  "Megakernel: row tiles per band of the GEMM tile order (1: row by row)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--row-order", o->row_order, "Megakernel: order of the sources' rows in each expert segment")
      ->check(CLI::IsMember({"rate-based", "round-robin"}));
  cmd->add_option("--context", o->context,
                  "Megakernel: the backward's saved context. resident: the ring (--macrobatch) grows to hold every "
                  "routed row, which the backward reads back | replay: the backward pulls x again and recomputes "
                  "gate|up (needs --macrobatch below the case's rows) | auto: as --macrobatch gives it")
      ->check(CLI::IsMember({"auto", "resident", "replay"}));
  cmd->add_option("--timeline", o->timeline, "Megakernel: write the first case's task timeline to FILE (JSON lines)");
  cmd->add_option("--save", o->save,
                  "CUDA: what a forward keeps for its backward on the staged paths: gate_up (the routed rows' gate "
                  "and up products) | none (the routes only; backward recomputes gate|up from x)")
      ->check(CLI::IsMember({"gate_up", "none"}));
  cmd->add_option("--depth", o->depth,
                  "CUDA layer runs: also measure the device memory of a stack of this many layers, forward through "
                  "all, then backward through all (stack_peak_memory_bytes)")
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--breakdown", o->breakdown,
                "CUDA layer runs: also time each stage of both paths, forward and backward (medians of --iters "
                "more steps; the rows' 'stages' field)");
  cmd->add_flag("--no-baselines", o->no_baselines,
                "CUDA on one GPU: time the single-GPU and megakernel paths only (no fused-SwiGLU comparison)");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace moka::cli
