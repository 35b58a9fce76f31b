// Non-owning views of dense row-major tensors, with dtype and device.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "moka/error.hpp"

namespace moka {

enum class DType : uint8_t { f32, f64, bf16, i32, i64 };
enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceKind::cuda, i}; }
  bool operator==(const Device&) const = default;
};

size_t dtype_size(DType t);
const char* to_string(DType t);
std::string to_string(Device d);

inline constexpr int kMaxRank = 4;

// A contiguous row-major view. An empty view (data == nullptr, rank 0) stands for an absent
// optional tensor, e.g. no shared expert.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu();
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};

  TensorView() = default;
  TensorView(void* ptr, DType type, std::initializer_list<int64_t> dims, Device dev = Device::cpu());

  bool empty() const { return data == nullptr; }
  int64_t dim(int i) const { return shape.at(i); }
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  std::string shape_string() const;

  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// Checks a view's dtype, device and shape; `name` appears in the error message.
void expect_tensor(const TensorView& t, const char* name, DType dtype, Device device,
                   std::initializer_list<int64_t> shape);

}  // namespace moka
