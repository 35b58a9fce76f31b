// `moka bench`'s GPU parts in a build without the CUDA backend (CMake compiles this file instead
// of tools/gpu/): each says so.
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
std::vector<BenchRow> run_cuda_ep_case(ProcessGroup&, const NamedShape&, int64_t, const CudaBenchOptions&) {
  unavailable("moka bench --backend cuda");
}

}  // namespace moka::cli
