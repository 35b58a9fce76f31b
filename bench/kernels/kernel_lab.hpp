// The kernel lab's bench library (bench/kernels/README.md): what every lab executable shares.
// Each executable is one kernel's bench in the style of the CUTLASS examples: an options struct
// parsed with CLI11, a run, a check of its results, one JSON line per case on stdout (the row
// format of `moka bench --json`, tools/bench_report.hpp). Unlike `moka bench`, the lab reaches
// into the library's internals (src/cuda), so it is built with the CUDA backend only.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_report.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "gpu/device_tensors.hpp"
#include "gpu/gpu_timing.hpp"
#include "grouped_schedule.hpp"
#include "moka/megakernel.hpp"
#include "moka/process_group.hpp"

namespace moka::lab {

using cli::BenchRow;
using Dev = cli::DeviceBuffer;

// The cases of a run: every named shape at every token count, timed `iters` times after
// `warmup` runs. Each executable sets its own defaults before add_case_options.
struct CaseOptions {
  std::vector<std::string> shapes = {"qwen3-30b-a3b"};
  std::vector<int64_t> tokens = {16384};
  int iters = 10;
  int warmup = 2;
  uint64_t seed = 1;
};
// --shape, --tokens (comma lists), --iters, --warmup, --seed.
void add_case_options(CLI::App& app, CaseOptions& o);
// --comm-sms, --minibatch, --macrobatch, --band-rows: the megakernel's knobs.
void add_megakernel_options(CLI::App& app, MegakernelConfig& c);
void print_json_line(const BenchRow& row);

// The executable's main: parses the command line into the options `app` holds, then calls
// `run`. Exit codes as the moka CLI's: CLI11's for bad options, 2 for a moka::Error, 3 for any
// other exception, each printed as one line "<name>: <what>" on stderr.
int lab_main(CLI::App& app, int argc, char** argv, const std::function<void()>& run);

// The main of a bench over cases: the case options (and the megakernel's knobs, when given), then
// `run_case` for every shape and token count, each row printed as one JSON line, after
// cli::check_lab_row (a row with grouped rows outside tokens * k .. tokens * k + 127 * E, or
// above 100% of the dense peak, is an Error: exit code 2, no line).
using RunCase = std::function<BenchRow(const NamedShape&, int64_t)>;
int case_bench_main(CLI::App& app, int argc, char** argv, CaseOptions& cases, MegakernelConfig* megakernel,
                    const RunCase& run_case);

// Inside a worker process started by `moka launch -n N -- <lab executable> ...`: the GPU of this
// local rank, and the workers' TCP group; null when not started as a worker.
std::unique_ptr<ProcessGroup> join_workers();

// One expert's product over its routed rows: m = the expert's row count, A = its segment of the
// grouped buffer `a` ([rows, k], row pitch lda), B = its weights at b_off in buffer `b` ([n, k]),
// D = its segment of the grouped buffer `d` (row pitch ldd).
cuda::GroupSpec expert_rows_group(int e, int a, int64_t lda, int b, int64_t b_off, int64_t ldb, int d, int64_t ldd,
                                  int64_t n, int64_t k);

// One case's routed rows grouped by expert, as the megakernel core and the CUTLASS grouped GEMMs
// read them (EP = 1, routed experts only): random x, d_out and weights N(0, 1/fan_in), uniform
// routing with random route weights U(0, 1), the single-GPU schedule (tile_rows 128), and x
// gathered into the experts' segments of `grouped` ([rows, H], zero padding rows). The
// schedule's counts and offsets are checked against the routing on the host (Error otherwise).
struct GroupedRowsCase {
  MoeShape shape;
  int64_t tokens;
  std::vector<int32_t> topk;
  Dev x, d_out, ids, route_weights, wg, wu, wd;
  fixtures::GroupedSchedule sched;
  Dev grouped;
  GroupedRowsCase(const MoeShape& sh, int64_t tokens, int64_t rows, uint64_t seed, cudaStream_t s);
  std::vector<int32_t> counts() const;   // routed rows per expert
  std::vector<int32_t> offsets() const;  // each expert's first grouped row, then the rows in use
};

// The CPU reference of a forward over a case's grouped rows, on a sample (the first rows of a few
// experts spread over the ids; the whole shape would take the CPU hours): h = act(x W_gate^T,
// x W_up^T) from the bf16 inputs in double, and y = h W_down^T from the device's h, so each
// product is checked alone. The largest relative difference (max |a - b| / max |b| over the
// sample) of the device's `hidden` and `y` rows from the reference's.
double routed_rows_cpu_error(const GroupedRowsCase& in, const Dev& hidden, const Dev& y);

}  // namespace moka::lab
