// The CUDA backend on a machine without a GPU (CI): asking for it is a clear error, `auto`
// falls back to the CPU, and `moka bench --backend cuda` says why it cannot run.
#include <gtest/gtest.h>

#include "moka/moka.hpp"

using namespace moka;

TEST(CudaBackendWithoutGpu, ExplicitRequestIsAClearErrorAndAutoFallsBack) {
  if (cuda_backend_available()) GTEST_SKIP() << "a GPU is visible: tests/cuda covers this machine";
  const MoeShape s = named_shape("tiny").shape;
  try {
    make_moe_layer(s, Backend::cuda);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::backend_unavailable);
  }
  EXPECT_THROW(make_router(named_shape("tiny").router, Backend::cuda), Error);
  EXPECT_STREQ(make_moe_layer(s, Backend::automatic)->backend_name(), "cpu");
}
