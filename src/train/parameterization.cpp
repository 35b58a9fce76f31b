#include "train/parameterization.hpp"

#include <cmath>
#include <map>

#include "moka/error.hpp"

namespace moka::train {

const char* to_string(Parameterization p) { return p == Parameterization::mup ? "mup" : "sp"; }

Parameterization parse_parameterization(const std::string& name) {
  if (name == "sp") return Parameterization::sp;
  if (name == "mup") return Parameterization::mup;
  throw Error(ErrorCode::invalid_argument, "unknown parameterization '" + name + "' (sp, mup)");
}

namespace {

void require_same_fixed_dims(const ModelConfig& base, const ModelConfig& target) {
  auto same = [](int64_t a, int64_t b, const char* what) {
    require(a == b, ErrorCode::invalid_argument,
            std::string("muP width scaling keeps ") + what + " fixed, but base has " + std::to_string(a) +
                " and target " + std::to_string(b));
  };
  same(base.vocab, target.vocab, "vocab");
  same(base.num_layers, target.num_layers, "num_layers");
  same(base.head_dim, target.head_dim, "head_dim");
  same(base.top_k, target.top_k, "top_k");
  same(base.expert_intermediate, target.expert_intermediate, "expert_intermediate");
  same(base.dense_intermediate, target.dense_intermediate, "dense_intermediate");
  same(base.q_rank, target.q_rank, "q_rank");
  same(base.kv_rank, target.kv_rank, "kv_rank");
  same(base.shared_intermediate, target.shared_intermediate, "shared_intermediate");
  require(base.attention == target.attention, ErrorCode::invalid_argument, "base and target differ in attention kind");
}

void apply_sp(TensorRule& r) {
  const auto& s = r.spec;
  r.init_std = s.cls == TensorClass::embedding ? 1.0 : 1.0 / std::sqrt(double(s.fan_in));
}

void apply_mup(TensorRule& r, int64_t base_fan_in) {
  const auto& s = r.spec;
  switch (s.cls) {
    case TensorClass::embedding: r.init_std = 1.0; return;
    case TensorClass::output_head:
      // Constant init and logits x 1/m: the update of W x stays O(1) under Adam's O(1)
      // per-entry steps, and the init part of the logits shrinks as 1/sqrt(m).
      r.init_std = 1.0 / std::sqrt(double(base_fan_in));
      r.forward_multiplier = 1.0 / r.width_ratio;
      return;
    default:
      // Hidden matrices: variance 1/fan_in; Adam's per-entry step scaled by base_fan_in/fan_in
      // (1 where the fan-in is fixed), so W's update moves W x by O(1) at every width.
      r.init_std = 1.0 / std::sqrt(double(s.fan_in));
      r.lr_multiplier = 1.0 / r.width_ratio;
  }
}

}  // namespace

std::vector<TensorRule> parameterize(const ModelConfig& base, const ModelConfig& target, Parameterization p) {
  require_same_fixed_dims(base, target);
  std::map<std::string, TensorSpec> base_specs;
  for (auto& s : tensor_layout(base)) base_specs.emplace(s.name, s);
  std::vector<TensorRule> rules;
  for (auto& spec : tensor_layout(target)) {
    const TensorSpec& b = base_specs.at(spec.name);
    TensorRule r;
    r.spec = spec;
    r.fan_in_grows = spec.fan_in > b.fan_in;
    r.fan_out_grows = spec.fan_out > b.fan_out;
    require(spec.fan_in >= b.fan_in && spec.fan_out >= b.fan_out, ErrorCode::invalid_argument,
            "target is narrower than base in " + spec.name);
    if (spec.cls == TensorClass::norm_gain) {
      r.init_ones = true;
      r.weight_decay_multiplier = 0.0;
    } else {
      r.width_ratio = double(spec.fan_in) / double(b.fan_in);
      if (p == Parameterization::mup) {
        apply_mup(r, b.fan_in);
      } else {
        apply_sp(r);
      }
    }
    rules.push_back(std::move(r));
  }
  return rules;
}

}  // namespace moka::train
