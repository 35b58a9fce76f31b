// The nn grouped GEMM (see GemmLayout in grouped_gemm.hpp): A RowMajor, B RowMajor in CUTLASS terms.
#include <cutlass/layout/matrix.h>

namespace moka::cuda {
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::RowMajor;
}  // namespace moka::cuda

#include "cuda/gemm_runner_impl.cuh"

namespace moka::cuda {

std::unique_ptr<GemmRunner> make_gemm_runner_nn(const GroupArrays& arrays, const std::vector<GroupSpec>& specs,
                                                 int device) {
  return std::make_unique<CutlassGemmRunner<GroupedGemmConfig>>(arrays, specs, device);
}

}  // namespace moka::cuda
