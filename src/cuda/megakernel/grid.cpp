// The SMs a persistent megakernel grid may occupy (launch.hpp). The driver API is
// reached through the runtime's entry points, so that binaries do not link libcuda (they load
// on machines without a driver, as CI's).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/check.hpp"
#include "cuda/megakernel/launch.hpp"

namespace moka::cuda {
namespace {

template <typename Fn>
Fn driver_function(const char* name, unsigned version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // a driver without the entry point: not an error of later calls
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

using CtxGetCurrent = CUresult (*)(CUcontext*);
using CtxGetExecAffinity = CUresult (*)(CUexecAffinityParam*, CUexecAffinityType);
using CtxGetDevResource = CUresult (*)(CUcontext, CUdevResource*, CUdevResourceType);

}  // namespace

int context_sm_count() {
  int device = 0, sms = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  MOKA_CUDA_CHECK(cudaFree(nullptr));  // the runtime's context is current from here on
  static const auto get_current = driver_function<CtxGetCurrent>("cuCtxGetCurrent", 4000);
  static const auto get_affinity = driver_function<CtxGetExecAffinity>("cuCtxGetExecAffinity", 11040);
  static const auto get_resource = driver_function<CtxGetDevResource>("cuCtxGetDevResource", 12040);
  CUcontext context = nullptr;
  if (!get_current || get_current(&context) != CUDA_SUCCESS || context == nullptr) return sms;
  CUexecAffinityParam affinity = {};
  if (get_affinity && get_affinity(&affinity, CU_EXEC_AFFINITY_TYPE_SM_COUNT) == CUDA_SUCCESS &&
      affinity.param.smCount.val > 0)
    sms = std::min(sms, int(affinity.param.smCount.val));
  CUdevResource resource = {};
  if (get_resource && get_resource(context, &resource, CU_DEV_RESOURCE_TYPE_SM) == CUDA_SUCCESS &&
      resource.sm.smCount > 0)
    sms = std::min(sms, int(resource.sm.smCount));
  return sms;
}

}  // namespace moka::cuda
