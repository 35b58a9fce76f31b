// Internal: the CUTLASS kernel behind a plain interface, so the CUTLASS headers compile in one
// translation unit (gemm_cutlass.cu).
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "cuda/gemm/grouped_gemm.hpp"

namespace moka::cuda {

// Device arrays the setup kernel fills before every launch.
struct GroupArrays {
  int* problems = nullptr;  // [groups][3] (m, n, k), the layout of cute::Shape<int, int, int>
  const void** a = nullptr;
  const void** b = nullptr;
  void** d = nullptr;
  const void** c = nullptr;     // SwiGLU epilogue only: U
  void** aux = nullptr;         // SwiGLU epilogue only: G
  const float** sfa = nullptr;  // e4m3 operands only: A's and B's scales
  const float** sfb = nullptr;
};

class GemmRunner {
 public:
  virtual ~GemmRunner() = default;
  virtual void run(cudaStream_t stream) = 0;
};

// Throws unsupported_size for a layout (or layout and epilogue) with no compiled kernel (see
// GemmLayout, GemmEpilogue).
std::unique_ptr<GemmRunner> make_gemm_runner(const GroupArrays&, const std::vector<GroupSpec>&, GemmLayout layout,
                                             GemmEpilogue epilogue, int device);

}  // namespace moka::cuda
