// `moka simulate`: plans one MoE all-to-all epoch under every scheduling policy and simulates
// it (exact fluid model, or chunk-level with finite buffers and back-pressure), printing
// completion / T*, queues and pause time per policy (table, or JSON lines with --json).
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "bench_report.hpp"
#include "commands.hpp"
#include "core/atomic_file.hpp"
#include "moka/config.hpp"
#include "moka/error.hpp"
#include "option_checks.hpp"
#include "sched/packet_sim.hpp"
#include "sched/routing_dump.hpp"
#include "sched/two_tier.hpp"

namespace moka::cli {
namespace {

struct SimulateOptions {
  sched::SyntheticTraffic traffic;
  std::string routing = "zipf";
  std::string count = "route";
  std::string replay;
  std::string shape;  // a named shape: sets hidden, top-k and experts per GPU
  int hidden = 7168, dtype_bytes = 2;
  std::vector<std::string> policies;
  std::string model = "packet";
  double link_gbps = 450, nic_gbps = 50;
  int gpus_per_server = 0;
  double chunk_kb = 256, buffer_mb = 0, propagation_us = 0.5, barrier_us = 1;
  std::string back_pressure = "credit";
  int phase_budget = 0;
  std::string series_csv;
  int series_points = 200;
  bool json = false;
  bool gpus_given = false;  // --gpus on the command line (a replay must then match it)
};

std::vector<sched::Policy> chosen_policies(const SimulateOptions& o) {
  if (o.policies.empty()) return sched::all_policies();
  std::vector<sched::Policy> out;
  for (const auto& name : o.policies) out.push_back(sched::parse_policy(name));
  return out;
}

sched::TrafficMatrix synthetic_epoch(SimulateOptions& o, sched::CountMode mode) {
  auto& t = o.traffic;
  const int64_t experts = int64_t{t.gpus} * t.experts_per_gpu;
  require(t.top_k <= experts, ErrorCode::invalid_argument,
          "--top-k " + std::to_string(t.top_k) + " exceeds the " + std::to_string(experts) +
              " experts of --gpus x --experts-per-gpu");
  require(t.routing.locality < 1 || t.top_k <= t.experts_per_gpu, ErrorCode::invalid_argument,
          "--locality 1 draws every choice from the rank's own --experts-per-gpu " + std::to_string(t.experts_per_gpu) +
              " experts, fewer than --top-k " + std::to_string(t.top_k));
  require_host_memory(double(t.gpus) * double(t.tokens_per_rank) * t.top_k * sizeof(int32_t),
                      "--tokens " + std::to_string(t.tokens_per_rank), "the routing of --gpus x --tokens x --top-k");
  t.routing.kind = core::parse_routing_kind(o.routing);
  t.bytes_per_row = static_cast<int64_t>(o.hidden) * o.dtype_bytes;
  t.mode = mode;
  return sched::synthetic_traffic(t);
}

// Every line of a `moka bench --dump-routing` file; --gpus and --shape, when given, must match it.
std::vector<sched::TrafficMatrix> replayed_epochs(const SimulateOptions& o, sched::CountMode mode) {
  std::vector<sched::TrafficMatrix> out;
  const auto epochs = sched::read_routing_dump(o.replay);
  for (size_t e = 0; e < epochs.size(); ++e) {
    const auto& epoch = epochs[e];
    const std::string where = "epoch " + std::to_string(e) + " of routing dump " + o.replay;
    const auto world = static_cast<int>(epoch.topk_ids.size());
    require(!o.gpus_given || world == o.traffic.gpus, ErrorCode::invalid_argument,
            "--gpus " + std::to_string(o.traffic.gpus) + ", but " + where + " has " + std::to_string(world) + " ranks");
    require(o.shape.empty() || epoch.shape.empty() || o.shape == epoch.shape, ErrorCode::invalid_argument,
            "--shape " + o.shape + ", but " + where + " is of shape " + epoch.shape);
    out.push_back(sched::traffic_from_routing(epoch.topk_ids, epoch.top_k, epoch.num_experts,
                                              epoch.hidden * o.dtype_bytes, mode));
  }
  return out;
}

// One matrix per epoch: the synthetic one, or every line of a routing dump. An epoch whose
// routes all stay on their own GPU has nothing to schedule (and T* = 0).
std::vector<sched::TrafficMatrix> epochs(SimulateOptions& o) {
  const auto mode = sched::parse_count_mode(o.count);
  auto out = o.replay.empty() ? std::vector<sched::TrafficMatrix>{synthetic_epoch(o, mode)} : replayed_epochs(o, mode);
  for (size_t e = 0; e < out.size(); ++e)
    require(out[e].total() > 0, ErrorCode::invalid_argument,
            "epoch " + std::to_string(e) +
                " sends no bytes between GPUs (every route stays on its own GPU): "
                "nothing to schedule");
  return out;
}

sched::Fabric fabric_for(const SimulateOptions& o, int gpus) {
  require(o.gpus_per_server == 0 || gpus % o.gpus_per_server == 0, ErrorCode::invalid_argument,
          std::to_string(gpus) + " GPUs do not split into servers of --gpus-per-server " +
              std::to_string(o.gpus_per_server));
  sched::Fabric f;
  f.gpus = gpus, f.link_bw = o.link_gbps * 1e9, f.gpus_per_server = o.gpus_per_server, f.nic_bw = o.nic_gbps * 1e9;
  f.validate();
  return f;
}

// The packet model holds every chunk of the epoch at once.
void require_packet_memory(const SimulateOptions& o, const sched::TrafficMatrix& d) {
  if (o.model != "packet") return;
  constexpr double kBytesPerChunk = 64;  // the chunk and its release-order entry
  const double chunks = double(d.total()) / (o.chunk_kb * 1024) + double(d.n) * d.n;
  require_host_memory(chunks * kBytesPerChunk, "--chunk-kb " + std::to_string(o.chunk_kb), "the packet model's chunks");
}

sched::SimResult simulate_one(const SimulateOptions& o, sched::Policy p, const sched::TrafficMatrix& d,
                              const sched::Fabric& f, std::string& model) {
  const sched::PolicyOptions po{o.barrier_us * 1e-6, o.phase_budget};
  const int points = o.series_csv.empty() ? 0 : o.series_points;
  model = o.model == "packet" && p != sched::Policy::max_min_fair ? "packet" : "fluid";
  if (model == "fluid") return sched::simulate_policy_fluid(p, d, f, po, points);
  sched::PacketOptions pk;
  pk.chunk_bytes = static_cast<int64_t>(o.chunk_kb * 1024);
  pk.buffer_bytes = o.buffer_mb * (1 << 20);
  pk.mode = sched::parse_back_pressure(o.back_pressure);
  pk.propagation_s = o.propagation_us * 1e-6;
  pk.series_points = points;
  return sched::simulate_packets(p, d, f, po, pk);
}

std::string series_header(int gpus) {
  std::string header = "policy,epoch,time_s";
  for (int j = 0; j < gpus; ++j) header += ",q" + std::to_string(j);
  return header + "\n";
}

std::string series_rows(const sched::SimResult& r, int epoch) {
  std::ostringstream csv;
  for (size_t t = 0; t < r.series_times.size(); ++t) {
    csv << r.policy << "," << epoch << "," << r.series_times[t];
    for (double q : r.series[t]) csv << "," << q;
    csv << "\n";
  }
  return std::move(csv).str();
}

nlohmann::ordered_json row_json(const sched::SimResult& r, const std::string& model, const sched::TrafficMatrix& d,
                                const sched::LowerBound& lb, int epoch) {
  nlohmann::ordered_json j;
  j["policy"] = r.policy;
  j["model"] = model;
  j["epoch"] = epoch;
  j["gpus"] = d.n;
  j["receiver_gini"] = sched::receiver_gini(d);
  j["tstar_s"] = r.tstar_s;
  j["binding_port"] = lb.port;
  j["binding_is_receiver"] = lb.receiver;
  j["completion_s"] = r.completion_s;
  j["completion_over_tstar"] = r.completion_over_tstar();
  j["hot_receiver"] = r.hot_receiver;
  j["peak_hot_queue"] = r.peak_hot_queue();
  j["mean_hot_queue"] = r.mean_queue.at(r.hot_receiver);
  j["max_peak_queue"] = *std::max_element(r.peak_queue.begin(), r.peak_queue.end());
  j["pause_s"] = r.pause_s;
  j["phases"] = r.phases;
  return j;
}

void print_row(const nlohmann::ordered_json& j, bool json) {
  if (json) {
    std::cout << j.dump() << std::endl;
    return;
  }
  std::cout << std::left << std::setw(18) << j["policy"].get<std::string>() << std::setw(7)
            << j["model"].get<std::string>() << std::right << std::fixed << std::setprecision(4) << std::setw(10)
            << j["completion_over_tstar"].get<double>() << std::setprecision(2) << std::setw(14)
            << j["peak_hot_queue"].get<double>() / (1 << 20) << std::setw(14)
            << j["mean_hot_queue"].get<double>() / (1 << 20) << std::setprecision(1) << std::setw(12)
            << j["pause_s"].get<double>() * 1e6 << std::setw(8) << j["phases"].get<int>() << "\n";
}

void print_two_tier(const sched::TwoTierResult& r, int epoch, bool json) {
  nlohmann::ordered_json j;
  j["policy"] = "two-tier";
  j["model"] = "fluid";
  j["epoch"] = epoch;
  j["server_bound_s"] = r.server_bound_s;
  j["direct_nic_bound_s"] = r.direct_nic_bound_s;
  j["completion_s"] = r.completion_s;
  j["completion_over_server_bound"] = r.completion_s / r.server_bound_s;
  j["balance_s"] = r.balance_s;
  j["last_forward_s"] = r.last_forward_s;
  j["phases"] = r.phases;
  if (json) {
    std::cout << j.dump() << std::endl;
    return;
  }
  std::cout << "two-tier: completion / server-level bound " << r.completion_s / r.server_bound_s << " (bound "
            << r.server_bound_s * 1e6 << " us, direct NIC bound " << r.direct_nic_bound_s * 1e6 << " us, " << r.phases
            << " server phases)\n";
}

// --shape: the named shape's row width and top-k, and its experts spread over --gpus.
void apply_shape(SimulateOptions& o) {
  if (o.shape.empty()) return;
  const MoeShape& sh = named_shape(o.shape).shape;
  require(sh.num_experts % o.traffic.gpus == 0, ErrorCode::invalid_argument,
          o.shape + " has " + std::to_string(sh.num_experts) + " experts, which " + std::to_string(o.traffic.gpus) +
              " GPUs cannot share evenly");
  o.hidden = int(sh.hidden);
  o.traffic.top_k = int(sh.top_k);
  o.traffic.experts_per_gpu = int(sh.num_experts / o.traffic.gpus);
}

void run(SimulateOptions& o) {
  if (o.replay.empty()) apply_shape(o);
  // The series streams into a temporary file that replaces --series-csv once every epoch is in:
  // a run that fails part-way leaves the previous CSV (or none).
  std::optional<core::AtomicFile> series;
  if (!o.series_csv.empty()) {
    check_output_path("--series-csv", o.series_csv);
    series.emplace(o.series_csv);
  }
  const auto policies = chosen_policies(o);
  Progress progress("moka simulate");  // thousands of GPUs take minutes to route and per policy
  progress.update(o.replay.empty() ? "drawing the routing" : "reading " + o.replay, 0, int(policies.size()));
  const auto matrices = epochs(o);
  for (size_t e = 0; e < matrices.size(); ++e) {
    const auto& d = matrices[e];
    const auto f = fabric_for(o, d.n);
    require_packet_memory(o, d);
    const auto lb = sched::lower_bound(d, f);
    if (!o.json)
      std::cout << "epoch " << e << ": " << d.n << " GPUs, receiver Gini " << sched::receiver_gini(d) << ", T* "
                << lb.seconds * 1e6 << " us (" << (lb.receiver ? "ingress" : "egress") << " of GPU " << lb.port << ")\n"
                << "policy            model  compl/T*  peak hot MiB  mean hot MiB  pause us  phases\n";
    if (series && e == 0) series->write(series_header(d.n));
    for (size_t k = 0; k < policies.size(); ++k) {
      progress.update("epoch " + std::to_string(e) + " " + sched::to_string(policies[k]), int(k) + 1,
                      int(policies.size()));
      std::string model;
      const auto r = simulate_one(o, policies[k], d, f, model);
      print_row(row_json(r, model, d, lb, static_cast<int>(e)), o.json);
      if (series) series->write(series_rows(r, static_cast<int>(e)));
    }
    if (f.two_tier()) print_two_tier(sched::plan_two_tier(d, f, {o.barrier_us * 1e-6, 0}), static_cast<int>(e), o.json);
  }
  progress.finish();
  if (series) series->commit();
}

std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (sched::Policy p : sched::all_policies()) names.push_back(sched::to_string(p));
  return names;
}

}  // namespace

void register_simulate(CLI::App& app) {
  auto o = std::make_shared<SimulateOptions>();
  auto* cmd = app.add_subcommand("simulate", "Simulate one MoE all-to-all epoch under each scheduling policy");
  auto* gpus = cmd->add_option("--gpus", o->traffic.gpus, "GPUs (2 to " + std::to_string(sched::kMaxRanks) + ")")
                   ->check(CLI::Range(2, sched::kMaxRanks));
  auto* gini = cmd->add_option("--gini", o->traffic.routing.gini, "target per-expert load Gini of the Zipf routing")
                   ->check(gini_range());
  auto* routing = cmd->add_option("--routing", o->routing, "uniform | zipf | one-expert")
                      ->check(CLI::IsMember({"uniform", "zipf", "one-expert"}));
  auto* locality =
      cmd->add_option("--locality", o->traffic.routing.locality, "share of choices drawn from the rank's own experts")
          ->check(finite_range(0.0, 1.0));
  auto* seed = cmd->add_option("--seed", o->traffic.routing.seed, "routing seed");
  auto* tokens = cmd->add_option("--tokens", o->traffic.tokens_per_rank, "tokens per rank")
                     ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  auto* top_k = cmd->add_option("--top-k", o->traffic.top_k, "experts per token")->check(CLI::Range(1, 1024));
  auto* per_gpu = cmd->add_option("--experts-per-gpu", o->traffic.experts_per_gpu, "experts hosted by each GPU")
                      ->check(CLI::Range(1, 1 << 16));
  auto* hidden = cmd->add_option("--hidden", o->hidden, "row width (elements)")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--shape", o->shape, "named shape: its hidden size, top-k and experts over --gpus")
      ->excludes(top_k)
      ->excludes(per_gpu)
      ->excludes(hidden);
  cmd->add_option("--dtype-bytes", o->dtype_bytes, "bytes per element")->check(CLI::Range(1, 8));
  cmd->add_option("--count", o->count, "route: a row per (token, expert); gpu: a row per (token, receiving GPU)")
      ->check(CLI::IsMember({"route", "gpu"}));
  cmd->add_option("--replay", o->replay,
                  "routing dump of `moka bench --dump-routing` (one epoch per line; --gpus and --shape, if "
                  "given, must match it)")
      ->check(CLI::ExistingFile)
      ->excludes(gini)
      ->excludes(routing)
      ->excludes(locality)
      ->excludes(seed)
      ->excludes(tokens)
      ->excludes(top_k)
      ->excludes(per_gpu)
      ->excludes(hidden);
  cmd->add_option("--policies", o->policies, "policies to run (default: all)")
      ->delimiter(',')
      ->check(CLI::IsMember(policy_names()));
  cmd->add_option("--model", o->model, "packet (chunk level; max-min-fair stays fluid) | fluid")
      ->check(CLI::IsMember({"packet", "fluid"}));
  cmd->add_option("--link-gbps", o->link_gbps, "per-GPU NVLink bandwidth per direction, GB/s")
      ->check(finite_range(1e-3, 1e6));
  cmd->add_option("--gpus-per-server", o->gpus_per_server, "two-tier fabric: GPUs per server (0: single tier)")
      ->check(CLI::Range(0, sched::kMaxRanks));
  cmd->add_option("--nic-gbps", o->nic_gbps, "two-tier fabric: per-GPU NIC bandwidth per direction, GB/s")
      ->check(finite_range(1e-3, 1e6));
  cmd->add_option("--chunk-kb", o->chunk_kb, "packet model: chunk size, KiB")->check(finite_range(1.0, double(1 << 20)));
  cmd->add_option("--buffer-mb", o->buffer_mb, "packet model: buffer per output port, MiB (0: unbounded)")
      ->check(finite_range(0.0, 1e6));
  cmd->add_option("--back-pressure", o->back_pressure, "packet model: credit | pfc")
      ->check(CLI::IsMember({"credit", "pfc"}));
  cmd->add_option("--propagation-us", o->propagation_us, "packet model: per-hop propagation delay, us")
      ->check(finite_range(0.0, 1e6));
  cmd->add_option("--barrier-us", o->barrier_us, "cost of one barrier between phases, us")
      ->check(finite_range(0.0, 1e6));
  cmd->add_option("--phase-budget", o->phase_budget, "greedy-matching: phases before the rate-based tail (0: GPUs)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--series-csv", o->series_csv, "write every port's queue over time (policy,epoch,time_s,q0..)");
  cmd->add_option("--series-points", o->series_points, "samples per policy in --series-csv")
      ->check(CLI::Range(2, 1 << 20));
  cmd->add_flag("--json", o->json, "one JSON line per policy");
  cmd->callback([o, gpus] {
    o->gpus_given = gpus->count() > 0;
    run(*o);
  });
}

}  // namespace moka::cli
