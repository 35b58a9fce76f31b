#include "moka/tensor.hpp"

#include <sstream>

namespace moka {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

const char* to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

std::string to_string(Device d) {
  return d.kind == DeviceKind::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

TensorView::TensorView(void* ptr, DType type, std::initializer_list<int64_t> dims, Device dev)
    : data(ptr), dtype(type), device(dev), rank(static_cast<int>(dims.size())) {
  require(rank <= kMaxRank, ErrorCode::invalid_argument, "tensor rank above 4");
  int i = 0;
  for (int64_t d : dims) shape[i++] = d;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < rank; ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

void expect_tensor(const TensorView& t, const char* name, DType dtype, Device device,
                   std::initializer_list<int64_t> shape) {
  require(!t.empty() || t.rank > 0 || shape.size() == 0, ErrorCode::invalid_argument,
          std::string(name) + " is missing");
  require(t.data != nullptr || TensorView(nullptr, dtype, shape).numel() == 0, ErrorCode::invalid_argument,
          std::string(name) + " has no data");
  require(t.dtype == dtype, ErrorCode::invalid_argument,
          std::string(name) + " has dtype " + to_string(t.dtype) + ", expected " + to_string(dtype));
  require(t.device == device, ErrorCode::invalid_argument,
          std::string(name) + " is on " + to_string(t.device) + ", expected " + to_string(device));
  const TensorView want(nullptr, dtype, shape);
  bool same = want.rank == t.rank;
  for (int i = 0; same && i < t.rank; ++i) same = want.shape[i] == t.shape[i];
  require(same, ErrorCode::shape_mismatch,
          std::string(name) + " has shape " + t.shape_string() + ", expected " + want.shape_string());
}

}  // namespace moka
