// What the CUDA training tests share (test_train_gpu_*.cpp): a fresh seed per run, printed so a
// failure can be replayed, and the relative error of a GPU result against its CPU reference.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <vector>

namespace moka::train::gpu_test {

// ||gpu - cpu|| / ||cpu||, and infinity when the GPU left a non-finite value.
inline double rel_error(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  EXPECT_EQ(gpu.size(), cpu.size());
  double diff = 0, ref = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (!std::isfinite(gpu[i])) return INFINITY;
    diff += (double(gpu[i]) - cpu[i]) * (double(gpu[i]) - cpu[i]);
    ref += double(cpu[i]) * cpu[i];
  }
  return std::sqrt(diff / std::max(ref, 1e-300));
}

inline uint64_t fresh_seed() {
  const uint64_t seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  std::cout << "[ seed     ] " << seed << std::endl;
  return seed;
}

}  // namespace moka::train::gpu_test
