// The GPU commands in a build without the CUDA backend (CMake compiles this file instead of
// tools/gpu/): each says so.
#include "bench_cuda.hpp"
#include "moka/error.hpp"

namespace moka::cli {
namespace {
[[noreturn]] void unavailable(const std::string& what) {
  throw Error(ErrorCode::backend_unavailable, what + " needs the CUDA backend (this build has none)");
}
}  // namespace

void select_worker_device(int) {}
std::vector<BenchRow> run_cuda_case(const NamedShape&, int64_t, const CudaBenchOptions&) {
  unavailable("moka bench --backend cuda");
}
BenchRow run_cuda_core_case(const NamedShape&, int64_t, const CudaBenchOptions&) {
  unavailable("moka bench --mode core");
}
BenchRow run_cuda_backward_core_case(const NamedShape&, int64_t, const CudaBenchOptions&) {
  unavailable("moka bench --mode backward-core");
}
void serve_cuda_steps(const NamedShape&, int64_t, const CudaBenchOptions&, std::istream&, std::ostream&) {
  unavailable("moka bench --paired-steps");
}
std::vector<BenchRow> run_cuda_ep_case(ProcessGroup&, const NamedShape&, int64_t, const CudaBenchOptions&) {
  unavailable("moka bench --backend cuda");
}
std::vector<BenchRow> run_megakernel_tune(ProcessGroup*, const NamedShape&, int64_t, const CudaBenchOptions&,
                                          const std::vector<int>&, const std::vector<int64_t>&) {
  unavailable("moka tune");
}
std::vector<IncastRow> run_incast(ProcessGroup&, size_t, int) { unavailable("moka incast"); }

}  // namespace moka::cli
