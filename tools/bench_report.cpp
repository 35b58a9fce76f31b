#include "bench_report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/atomic_file.hpp"
#include "moka/moka.hpp"

namespace moka::cli {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<int64_t> routes_per_rank(const std::vector<int32_t>& ids, int64_t experts_per_rank, int ranks) {
  std::vector<int64_t> routes(ranks, 0);
  for (int32_t id : ids) routes.at(id / experts_per_rank)++;
  return routes;
}

double LayerFloor::forward_ms() const { return std::max(flops_ms, bytes_ms); }
double LayerFloor::backward_ms() const { return std::max(2 * flops_ms, bytes_ms); }

LayerFloor layer_floor(const MoeShape& sh, int64_t tokens, const std::vector<int64_t>& routes, int R,
                       double peak_tflops, std::optional<double> link_gbs) {
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
  const double flops =
      6.0 * double(most_rows) * sh.hidden * sh.intermediate + 6.0 * double(tokens) * sh.hidden * sh.shared_intermediate;
  LayerFloor f;
  f.flops_ms = flops / (peak_tflops * 1e12) * 1e3;
  if (link_gbs) f.bytes_ms = double(most_inbound) * sh.hidden * 2 / (*link_gbs * 1e9) * 1e3;
  return f;
}

void set_floor(BenchRow& row, const LayerFloor& floor, double peak_tflops) {
  row.floor_fwdbwd_ms = floor.fwdbwd_ms();
  auto& e = row.extra;
  e["dense_peak_tflops"] = peak_tflops;
  e["floor_fwd_ms"] = floor.forward_ms();
  e["floor_bwd_ms"] = floor.backward_ms();
  e["floor_flops_ms"] = floor.flops_ms;
  e["floor_bytes_ms"] = floor.bytes_ms;
}

TorchResult torch_result(const std::string& path, const std::string& shape, int64_t tokens, int ep) {
  TorchResult r;
  if (path.empty()) return r;
  std::ifstream f(path);
  require(f.good(), ErrorCode::io, "cannot read torch results " + path);
  std::string line;
  for (int number = 1; std::getline(f, line); ++number) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    require(!j.is_discarded() && j.is_object(), ErrorCode::io,
            "torch results " + path + " line " + std::to_string(number) + ": not a JSON object");
    if (j.value("shape", "") != shape || j.value("tokens_per_rank", int64_t(0)) != tokens || j.value("ep", 1) != ep)
      continue;
    r = TorchResult{j.value("fwdbwd_ms", 0.0), j.value("fwd_ms", 0.0), j.value("peak_memory_bytes", int64_t(0))};
    auto bytes = [&](const char* field) {
      return j.contains(field) && j[field].is_number() ? j[field].get<int64_t>() : 0;
    };
    r.stack_peak_memory_bytes = bytes("stack_peak_memory_bytes");
    r.saved_bytes_per_layer = bytes("saved_bytes_per_layer");
    r.depth = j.value("depth", 1);
    if (j.contains("paired")) {
      const auto& p = j["paired"];
      r.paired_ratio = p.value("median_ratio", 0.0);
      r.paired_moka_ms = p.value("moka_median_ms", 0.0);
      r.paired_runs = p.value("runs", 0);
    }
  }
  return r;
}

void set_torch(BenchRow& row, const TorchResult& torch) {
  if (torch.fwdbwd_ms <= 0) return;
  row.torch_fwdbwd_ms = torch.fwdbwd_ms;
  if (torch.peak_memory_bytes > 0) row.torch_peak_memory_bytes = torch.peak_memory_bytes;
}

namespace {
template <typename T>
nlohmann::ordered_json or_null(const std::optional<T>& v) {
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json();
}
}  // namespace

std::string bench_json(const BenchRow& r) {
  nlohmann::ordered_json j;
  j["shape"] = r.shape;
  j["backend"] = r.backend;
  j["path"] = r.path;
  j["ep"] = r.ep;
  j["tokens_per_rank"] = r.tokens_per_rank;
  j["dtype"] = r.dtype;
  j["routing"] = r.routing;
  j["iters"] = r.iters;
  j["fwd_ms"] = r.fwd_ms;
  j["bwd_ms"] = r.bwd_ms;
  j["fwdbwd_ms"] = r.fwdbwd_ms;
  j["tflops"] = r.tflops;
  j["max_rel_error"] = or_null(r.max_rel_error);
  const bool floor = r.floor_fwdbwd_ms && *r.floor_fwdbwd_ms > 0;
  j["floor_fwdbwd_ms"] = or_null(r.floor_fwdbwd_ms);
  j["fwdbwd_vs_floor"] = floor ? nlohmann::ordered_json(r.fwdbwd_ms / *r.floor_fwdbwd_ms) : nlohmann::ordered_json();
  j["peak_memory_bytes"] = or_null(r.peak_memory_bytes);
  j["torch_fwdbwd_ms"] = or_null(r.torch_fwdbwd_ms);
  j["speedup_vs_torch"] =
      r.torch_fwdbwd_ms ? nlohmann::ordered_json(*r.torch_fwdbwd_ms / r.fwdbwd_ms) : nlohmann::ordered_json();
  j["torch_peak_memory_bytes"] = or_null(r.torch_peak_memory_bytes);
  j["commit"] = build_commit();
  j["device"] = r.device;
  j.update(r.extra);
  return j.dump();
}

void print_cuda_comparison(std::ostream& os, const std::vector<BenchRow>& rows) {
  // vs_torch: ratio of the two medians; vs_torch_paired: median of per-run ratios (see TorchResult).
  char line[256];
  // fused_fwd: forward speedup of the SwiGLU epilogue over the unfused path (median of paired
  // runs; "!" when their bits differ).
  std::snprintf(line, sizeof(line), "%-16s %7s %4s %9s %10s %10s %10s %10s %10s %16s\n", "shape", "tokens", "ep",
                "peak_TF", "fused_fwd", "a2a_GB/s", "copy_GB/s", "torch_ms", "vs_torch", "vs_torch_paired");
  os << line;
  for (const auto& r : rows) {
    const auto& j = r.extra;
    std::snprintf(line, sizeof(line), "%-16s %7lld %4d %9.1f %9.2fx%s %10.1f %10.1f %10.2f %9.2fx %9.2fx (n=%d)\n",
                  r.shape.c_str(), static_cast<long long>(r.tokens_per_rank), r.ep, j.value("dense_peak_tflops", 0.0),
                  j.value("fused_swiglu_fwd_speedup", 0.0), j.value("fused_swiglu_identical", true) ? " " : "!",
                  j.value("nccl_all_to_all_gbs", 0.0), j.value("peer_copy_gbs", 0.0), r.torch_fwdbwd_ms.value_or(0.0),
                  r.torch_fwdbwd_ms.value_or(0.0) / r.fwdbwd_ms, j.value("speedup_vs_torch_paired", 0.0),
                  j.value("paired_runs", 0));
    os << line;
  }
}

void print_stage_breakdown(std::ostream& os, const std::vector<BenchRow>& rows) {
  os << "\nstage medians (ms):\n";
  for (const auto& r : rows) {
    const auto stages = r.extra.find("stages");
    if (stages == r.extra.end()) continue;
    for (const auto& [direction, list] : stages->items()) {
      char head[96];
      std::snprintf(head, sizeof(head), "%-16s %7lld %-11s %-8s", r.shape.c_str(),
                    static_cast<long long>(r.tokens_per_rank), r.path.c_str(), direction.c_str());
      os << head;
      for (const auto& [stage, ms] : list.items())
        os << " " << stage << " " << std::fixed << std::setprecision(3) << ms.get<double>();
      os << "\n";
    }
  }
  os << std::defaultfloat;
}

void print_floor_comparison(std::ostream& os, const std::vector<BenchRow>& rows) {
  // vs_floor: fwd+bwd over its floor; peak_MiB: the path's layer memory (saved context +
  // workspace; "-" where not measured); vs_torch: torch's fwd+bwd over this row's.
  char line[256];
  std::snprintf(line, sizeof(line), "%-16s %-11s %7s %4s %11s %10s %9s %10s %11s %9s\n", "shape", "path", "tokens",
                "ep", "fwd+bwd_ms", "floor_ms", "vs_floor", "peak_MiB", "torch_MiB", "vs_torch");
  os << line;
  auto mib = [](const std::optional<int64_t>& bytes) {
    char text[32] = "-";
    if (bytes) std::snprintf(text, sizeof(text), "%.1f", double(*bytes) / (1 << 20));
    return std::string(text);
  };
  auto ratio = [](std::optional<double> a, std::optional<double> b) {
    char text[32] = "-";
    if (a && b && *b > 0) std::snprintf(text, sizeof(text), "%.2fx", *a / *b);
    return std::string(text);
  };
  for (const auto& r : rows) {
    std::snprintf(line, sizeof(line), "%-16s %-11s %7lld %4d %11.3f %10.3f %9s %10s %11s %9s\n", r.shape.c_str(),
                  r.path.c_str(), static_cast<long long>(r.tokens_per_rank), r.ep, r.fwdbwd_ms,
                  r.floor_fwdbwd_ms.value_or(0.0), ratio(r.fwdbwd_ms, r.floor_fwdbwd_ms).c_str(),
                  mib(r.peak_memory_bytes).c_str(), mib(r.torch_peak_memory_bytes).c_str(),
                  ratio(r.torch_fwdbwd_ms, r.fwdbwd_ms).c_str());
    os << line;
  }
}

void print_table(std::ostream& os, const std::vector<BenchRow>& rows) {
  os << std::left << std::setw(16) << "shape" << std::setw(10) << "path" << std::setw(8) << "backend" << std::setw(4)
     << "ep" << std::right << std::setw(8) << "tokens" << std::setw(11) << "fwd ms" << std::setw(11) << "bwd ms"
     << std::setw(11) << "fwd+bwd ms" << std::setw(10) << "TFLOP/s" << std::setw(12) << "max rel err"
     << "\n";
  for (const auto& r : rows) {
    os << std::left << std::setw(16) << r.shape << std::setw(10) << r.path << std::setw(8) << r.backend << std::setw(4)
       << r.ep << std::right << std::setw(8) << r.tokens_per_rank << std::fixed << std::setprecision(3) << std::setw(11)
       << r.fwd_ms << std::setw(11) << r.bwd_ms << std::setw(11) << r.fwdbwd_ms << std::setprecision(4) << std::setw(10)
       << r.tflops << std::scientific << std::setprecision(2) << std::setw(12);
    if (r.max_rel_error) {
      os << *r.max_rel_error;
    } else {
      os << "-";
    }
    os << std::defaultfloat << "\n";
  }
}

Progress::Progress(std::string label) : label_(std::move(label)), tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::update(const std::string& what, int done, int total) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  char elapsed[32];
  std::snprintf(elapsed, sizeof elapsed, " %.1f s", seconds);
  const std::string line =
      label_ + " " + what + " [" + std::to_string(done) + "/" + std::to_string(total) + "]" + elapsed;
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s", line.c_str());
  } else if (what != last_) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  last_ = what;
}

void Progress::finish() {
  if (tty_) std::fprintf(stderr, "\r\033[K");
}

void check_lab_row(const BenchRow& row, const MoeShape& shape, int64_t tokens, int64_t tile_rows) {
  const std::string which = row.shape + " at " + std::to_string(tokens) + " tokens (" + row.path + "): ";
  if (row.extra.contains("grouped_rows")) {
    const nlohmann::ordered_json& v = row.extra.at("grouped_rows");
    const int64_t routes = tokens * shape.top_k, most = routes + (tile_rows - 1) * shape.num_experts;
    const int64_t rows = v.is_number_integer() ? v.get<int64_t>() : -1;
    require(rows >= routes && rows <= most, ErrorCode::internal,
            which + "grouped_rows " + v.dump() + " outside [" + std::to_string(routes) + ", " + std::to_string(most) +
                "] (" + std::to_string(tokens) + " tokens x top_k " + std::to_string(shape.top_k) + ", " +
                std::to_string(shape.num_experts) + " experts padded to " + std::to_string(tile_rows) +
                " rows): the row is not printed");
  }
  for (const auto& [key, v] : row.extra.items()) {
    const std::string suffix = "pct_peak";
    if (key.size() < suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const double pct = v.is_number() ? v.get<double>() : NAN;
    require(pct <= 100, ErrorCode::internal,
            which + key + " " + v.dump() + " is above 100% of the dense peak: the row is not printed");
  }
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
  core::append_file_atomically(path, j.dump() + "\n");
}

}  // namespace moka::cli
