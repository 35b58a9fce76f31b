#include <sstream>

#include "moka/config.hpp"
#include "moka/error.hpp"

namespace moka {

double MoeShape::forward_flops(int64_t tokens) const {
  const double t = static_cast<double>(tokens);
  return 6.0 * t * top_k * hidden * intermediate + 6.0 * t * hidden * shared_intermediate;
}

namespace {
NamedShape make(const char* name, int64_t h, int64_t i, int64_t e, int64_t k, int64_t is, ScoreFunction score,
                bool renorm, double scale, bool clamped = false) {
  NamedShape n;
  n.name = name;
  n.shape = MoeShape{h, i, e, k, is, clamped ? Activation::swiglu_clamped : Activation::swiglu, 7.0f};
  n.router = RouterConfig{};
  n.router.hidden = h;
  n.router.num_experts = e;
  n.router.top_k = k;
  n.router.score = score;
  n.router.renormalize = renorm;
  n.router.route_scale = scale;
  n.router.use_selection_bias = score == ScoreFunction::sigmoid;
  return n;
}
}  // namespace

const std::vector<NamedShape>& named_shapes() {
  // Published model configurations (hidden, moe_intermediate, experts, top-k, shared).
  static const std::vector<NamedShape> shapes = {
      make("qwen3-30b-a3b", 2048, 768, 128, 8, 0, ScoreFunction::softmax, true, 1.0),
      make("qwen3-235b-a22b", 4096, 1536, 128, 8, 0, ScoreFunction::softmax, true, 1.0),
      make("deepseek-v3", 7168, 2048, 256, 8, 2048, ScoreFunction::sigmoid, true, 2.5),
      make("gpt-oss-120b", 2880, 2880, 128, 4, 0, ScoreFunction::softmax, true, 1.0, true),
      make("mixtral-8x7b", 4096, 14336, 8, 2, 0, ScoreFunction::softmax, true, 1.0),
      // Small enough for a CPU: exercises every feature (shared expert, k > 1).
      make("tiny", 256, 128, 16, 4, 128, ScoreFunction::softmax, false, 1.0),
  };
  return shapes;
}

const NamedShape& named_shape(const std::string& name) {
  for (const auto& s : named_shapes())
    if (s.name == name) return s;
  std::ostringstream known;
  for (const auto& s : named_shapes()) known << ' ' << s.name;
  throw Error(ErrorCode::invalid_argument, "unknown shape '" + name + "'; known:" + known.str());
}

}  // namespace moka
