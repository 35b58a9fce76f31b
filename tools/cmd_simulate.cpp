// `moka simulate`: plans one MoE all-to-all epoch under every scheduling policy and simulates
// it (exact fluid model, or chunk-level with finite buffers and back-pressure), printing
// completion / T*, queues and pause time per policy (table, or JSON lines with --json).
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "moka/config.hpp"
#include "moka/error.hpp"
#include "sched/packet_sim.hpp"
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
};

std::vector<sched::Policy> chosen_policies(const SimulateOptions& o) {
  if (o.policies.empty()) return sched::all_policies();
  std::vector<sched::Policy> out;
  for (const auto& name : o.policies) out.push_back(sched::parse_policy(name));
  return out;
}

// One matrix per epoch: the synthetic one, or every line of a `moka bench --dump-routing` file.
std::vector<sched::TrafficMatrix> epochs(SimulateOptions& o) {
  const auto mode = sched::parse_count_mode(o.count);
  if (o.replay.empty()) {
    o.traffic.routing.kind = core::parse_routing_kind(o.routing);
    o.traffic.bytes_per_row = static_cast<int64_t>(o.hidden) * o.dtype_bytes;
    o.traffic.mode = mode;
    return {sched::synthetic_traffic(o.traffic)};
  }
  std::ifstream in(o.replay);
  require(in.good(), ErrorCode::io, "cannot read routing dump " + o.replay);
  std::vector<sched::TrafficMatrix> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    const int64_t row_bytes = j.at("hidden").get<int64_t>() * o.dtype_bytes;
    out.push_back(sched::traffic_from_routing(j.at("topk_ids").get<std::vector<std::vector<int32_t>>>(),
                                              j.at("top_k").get<int>(), j.at("num_experts").get<int>(), row_bytes, mode));
  }
  require(!out.empty(), ErrorCode::io, "routing dump " + o.replay + " holds no epoch");
  return out;
}

sched::Fabric fabric_for(const SimulateOptions& o, int gpus) {
  sched::Fabric f;
  f.gpus = gpus, f.link_bw = o.link_gbps * 1e9, f.gpus_per_server = o.gpus_per_server, f.nic_bw = o.nic_gbps * 1e9;
  f.validate();
  return f;
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

void write_series(std::ostream& csv, const sched::SimResult& r, int epoch) {
  for (size_t t = 0; t < r.series_times.size(); ++t) {
    csv << r.policy << "," << epoch << "," << r.series_times[t];
    for (double q : r.series[t]) csv << "," << q;
    csv << "\n";
  }
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
  std::cout << std::left << std::setw(18) << j["policy"].get<std::string>() << std::setw(7) << j["model"].get<std::string>()
            << std::right << std::fixed << std::setprecision(4) << std::setw(10) << j["completion_over_tstar"].get<double>()
            << std::setprecision(2) << std::setw(14) << j["peak_hot_queue"].get<double>() / (1 << 20) << std::setw(14)
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
            << r.server_bound_s * 1e6 << " us, direct NIC bound " << r.direct_nic_bound_s * 1e6 << " us, "
            << r.phases << " server phases)\n";
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
  apply_shape(o);
  std::ofstream csv;
  if (!o.series_csv.empty()) {
    csv.open(o.series_csv);
    require(csv.good(), ErrorCode::io, "cannot write " + o.series_csv);
  }
  const auto matrices = epochs(o);
  for (size_t e = 0; e < matrices.size(); ++e) {
    const auto& d = matrices[e];
    const auto f = fabric_for(o, d.n);
    const auto lb = sched::lower_bound(d, f);
    if (!o.json)
      std::cout << "epoch " << e << ": " << d.n << " GPUs, receiver Gini " << sched::receiver_gini(d) << ", T* "
                << lb.seconds * 1e6 << " us (" << (lb.receiver ? "ingress" : "egress") << " of GPU " << lb.port << ")\n"
                << "policy            model  compl/T*  peak hot MiB  mean hot MiB  pause us  phases\n";
    if (csv.is_open() && e == 0) {
      csv << "policy,epoch,time_s";
      for (int j = 0; j < d.n; ++j) csv << ",q" << j;
      csv << "\n";
    }
    for (sched::Policy p : chosen_policies(o)) {
      std::string model;
      const auto r = simulate_one(o, p, d, f, model);
      print_row(row_json(r, model, d, lb, static_cast<int>(e)), o.json);
      if (csv.is_open()) write_series(csv, r, static_cast<int>(e));
    }
    if (f.two_tier()) print_two_tier(sched::plan_two_tier(d, f, {o.barrier_us * 1e-6, 0}), static_cast<int>(e), o.json);
  }
}

}  // namespace

void register_simulate(CLI::App& app) {
  auto o = std::make_shared<SimulateOptions>();
  auto* cmd = app.add_subcommand("simulate", "Simulate one MoE all-to-all epoch under each scheduling policy");
  cmd->add_option("--gpus", o->traffic.gpus, "GPUs (8 to 1024)")->check(CLI::Range(2, 4096));
  cmd->add_option("--gini", o->traffic.routing.gini, "target per-expert load Gini of the Zipf routing");
  cmd->add_option("--routing", o->routing, "uniform | zipf | one-expert");
  cmd->add_option("--locality", o->traffic.routing.locality, "share of choices drawn from the rank's own experts");
  cmd->add_option("--seed", o->traffic.routing.seed, "routing seed");
  cmd->add_option("--tokens", o->traffic.tokens_per_rank, "tokens per rank");
  auto* top_k = cmd->add_option("--top-k", o->traffic.top_k, "experts per token");
  auto* per_gpu = cmd->add_option("--experts-per-gpu", o->traffic.experts_per_gpu, "experts hosted by each GPU");
  auto* hidden = cmd->add_option("--hidden", o->hidden, "row width (elements)");
  cmd->add_option("--shape", o->shape, "named shape: its hidden size, top-k and experts over --gpus")
      ->excludes(top_k)
      ->excludes(per_gpu)
      ->excludes(hidden);
  cmd->add_option("--dtype-bytes", o->dtype_bytes, "bytes per element");
  cmd->add_option("--count", o->count, "route: a row per (token, expert); gpu: a row per (token, receiving GPU)");
  cmd->add_option("--replay", o->replay, "routing dump of `moka bench --dump-routing` (one epoch per line)");
  cmd->add_option("--policies", o->policies, "policies to run (default: all)")->delimiter(',');
  cmd->add_option("--model", o->model, "packet (chunk level; max-min-fair stays fluid) | fluid");
  cmd->add_option("--link-gbps", o->link_gbps, "per-GPU NVLink bandwidth per direction, GB/s");
  cmd->add_option("--gpus-per-server", o->gpus_per_server, "two-tier fabric: GPUs per server (0: single tier)");
  cmd->add_option("--nic-gbps", o->nic_gbps, "two-tier fabric: per-GPU NIC bandwidth per direction, GB/s");
  cmd->add_option("--chunk-kb", o->chunk_kb, "packet model: chunk size, KiB");
  cmd->add_option("--buffer-mb", o->buffer_mb, "packet model: buffer per output port, MiB (0: unbounded)");
  cmd->add_option("--back-pressure", o->back_pressure, "packet model: credit | pfc");
  cmd->add_option("--propagation-us", o->propagation_us, "packet model: per-hop propagation delay, us");
  cmd->add_option("--barrier-us", o->barrier_us, "cost of one barrier between phases, us");
  cmd->add_option("--phase-budget", o->phase_budget, "greedy-matching: phases before the rate-based tail (0: GPUs)");
  cmd->add_option("--series-csv", o->series_csv, "write every port's queue over time (policy,epoch,time_s,q0..)");
  cmd->add_option("--series-points", o->series_points, "samples per policy in --series-csv");
  cmd->add_flag("--json", o->json, "one JSON line per policy");
  cmd->callback([o] { run(*o); });
}

}  // namespace moka::cli
