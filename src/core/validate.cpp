#include "core/validate.hpp"

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace moka::core {

void validate_shape(const MoeShape& s, int world_size) {
  auto positive = [](int64_t v, const char* what) {
    require(v > 0, ErrorCode::invalid_argument, std::string(what) + " must be positive, got " + std::to_string(v));
  };
  positive(s.hidden, "hidden");
  positive(s.intermediate, "intermediate");
  positive(s.num_experts, "num_experts");
  positive(s.top_k, "top_k");
  require(s.shared_intermediate >= 0, ErrorCode::invalid_argument, "shared_intermediate must be >= 0");
  require(world_size >= 1, ErrorCode::invalid_argument, "world size must be >= 1");
  require(s.top_k <= s.num_experts, ErrorCode::invalid_argument,
          "top_k " + std::to_string(s.top_k) + " exceeds num_experts " + std::to_string(s.num_experts));
  require(s.num_experts % world_size == 0, ErrorCode::invalid_argument,
          "num_experts " + std::to_string(s.num_experts) + " is not divisible by the " + std::to_string(world_size) +
              " expert-parallel ranks");
  require(s.activation != Activation::swiglu_clamped || (std::isfinite(s.clamp_limit) && s.clamp_limit > 0),
          ErrorCode::invalid_argument, "clamp_limit must be a positive finite number");
}

template <typename W>
void validate_routing(const int32_t* ids, const W* weights, int64_t tokens, int64_t top_k, int64_t num_experts) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = ids[t * top_k + j];
      if (e < 0 || e >= num_experts) {
        std::ostringstream os;
        os << "topk_ids[" << t << ", " << j << "] = " << e << " is outside [0, " << num_experts << ")";
        throw Error(ErrorCode::expert_out_of_range, os.str());
      }
      for (int64_t i = 0; i < j; ++i) {
        if (ids[t * top_k + i] == e) {
          std::ostringstream os;
          os << "token " << t << " selects expert " << e << " twice (top-k slots " << i << " and " << j << ")";
          throw Error(ErrorCode::duplicate_expert, os.str());
        }
      }
      const double w = static_cast<double>(weights[t * top_k + j]);
      if (!std::isfinite(w)) {
        std::ostringstream os;
        os << "topk_weights[" << t << ", " << j << "] = " << w;
        throw Error(ErrorCode::non_finite, os.str());
      }
    }
  }
}
template void validate_routing<float>(const int32_t*, const float*, int64_t, int64_t, int64_t);
template void validate_routing<double>(const int32_t*, const double*, int64_t, int64_t, int64_t);

DType router_weight_dtype(DType act) { return act == DType::f64 ? DType::f64 : DType::f32; }

namespace {
void expect_optional(const TensorView& t, bool present, const char* name, DType dtype, Device device,
                     std::initializer_list<int64_t> shape) {
  if (present) {
    expect_tensor(t, name, dtype, device, shape);
  } else {
    require(t.empty(), ErrorCode::invalid_argument, std::string(name) + " given but the shape has no shared expert");
  }
}
}  // namespace

void validate_layer_tensors(const MoeShape& s, int world_size, const MoeInputs& in, const MoeWeights& w, DType act,
                            Device device) {
  require(in.x.rank == 2, ErrorCode::shape_mismatch, "x must be [T, H], got " + in.x.shape_string());
  const int64_t T = in.x.dim(0), H = s.hidden, I = s.intermediate, k = s.top_k;
  const int64_t El = s.num_experts / world_size, Is = s.shared_intermediate;
  expect_tensor(in.x, "x", act, device, {T, H});
  expect_tensor(in.topk_ids, "topk_ids", DType::i32, device, {T, k});
  expect_tensor(in.topk_weights, "topk_weights", router_weight_dtype(act), device, {T, k});
  expect_tensor(w.w_gate, "w_gate", act, device, {El, I, H});
  expect_tensor(w.w_up, "w_up", act, device, {El, I, H});
  expect_tensor(w.w_down, "w_down", act, device, {El, H, I});
  expect_optional(w.ws_gate, s.has_shared(), "ws_gate", act, device, {Is, H});
  expect_optional(w.ws_up, s.has_shared(), "ws_up", act, device, {Is, H});
  expect_optional(w.ws_down, s.has_shared(), "ws_down", act, device, {H, Is});
}

void validate_layer_gradients(const MoeShape& s, int world_size, int64_t T, const MoeGradients& g, DType act,
                              Device device) {
  const int64_t H = s.hidden, I = s.intermediate, k = s.top_k;
  const int64_t El = s.num_experts / world_size, Is = s.shared_intermediate;
  expect_tensor(g.d_x, "d_x", act, device, {T, H});
  expect_tensor(g.d_topk_weights, "d_topk_weights", router_weight_dtype(act), device, {T, k});
  expect_tensor(g.d_w_gate, "d_w_gate", act, device, {El, I, H});
  expect_tensor(g.d_w_up, "d_w_up", act, device, {El, I, H});
  expect_tensor(g.d_w_down, "d_w_down", act, device, {El, H, I});
  expect_optional(g.d_ws_gate, s.has_shared(), "d_ws_gate", act, device, {Is, H});
  expect_optional(g.d_ws_up, s.has_shared(), "d_ws_up", act, device, {Is, H});
  expect_optional(g.d_ws_down, s.has_shared(), "d_ws_down", act, device, {H, Is});
}

namespace {
struct Outcome {
  LayerSignature signature;
  int32_t failed = 0;
  int32_t code = 0;
  char message[472] = {};
};

std::string describe(const LayerSignature& s) {
  std::ostringstream os;
  os << "T=" << s.tokens << " H=" << s.hidden << " I=" << s.intermediate << " E=" << s.experts << " k=" << s.top_k
     << " Is=" << s.shared << " dtype=" << to_string(static_cast<DType>(s.dtype));
  return os.str();
}
}  // namespace

void validate_collectively(ProcessGroup* group, const LayerSignature& signature,
                           const std::function<void()>& local_check) {
  Outcome mine;
  mine.signature = signature;
  try {
    local_check();
  } catch (const Error& e) {
    mine.failed = 1;
    mine.code = static_cast<int32_t>(e.code());
    std::strncpy(mine.message, e.what(), sizeof(mine.message) - 1);
  }
  // The message without the "<code>: " prefix Error::what() carries; Error re-attaches it.
  auto message_of = [](const Outcome& o) {
    std::string msg = o.message;
    const std::string prefix = std::string(to_string(static_cast<ErrorCode>(o.code))) + ": ";
    return msg.rfind(prefix, 0) == 0 ? msg.substr(prefix.size()) : msg;
  };
  if (group == nullptr || group->size() == 1) {
    if (mine.failed) throw Error(static_cast<ErrorCode>(mine.code), message_of(mine));
    return;
  }
  std::vector<Outcome> all(group->size());
  group->all_gather(&mine, all.data(), sizeof(Outcome));
  for (int r = 0; r < group->size(); ++r) {
    if (all[r].failed)
      throw Error(static_cast<ErrorCode>(all[r].code), "rank " + std::to_string(r) + ": " + message_of(all[r]));
  }
  for (int r = 1; r < group->size(); ++r) {
    require(all[r].signature == all[0].signature, ErrorCode::shape_mismatch,
            "ranks disagree on the layer: rank 0 has " + describe(all[0].signature) + ", rank " + std::to_string(r) +
                " has " + describe(all[r].signature));
  }
}

}  // namespace moka::core
