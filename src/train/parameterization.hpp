// SP and muP for AdamW, per tensor, inferred from a base config and a target config alone
// (nothing is allocated). The rules follow the table of shared/research/mup-transfer.md:
//   m_in = fan_in / base_fan_in (how much a tensor's fan-in grew).
//   muP: hidden matrices init std 1/sqrt(fan_in); LR multiplier 1/m_in (1 where the fan-in is
//        fixed: MLA up-projections, expert/shared/dense FC2); embedding std 1, LR 1; output head
//        init std 1/sqrt(base_fan_in) (the base model's), LR 1, forward multiplier 1/m_in;
//        norm gains init 1, LR 1.
//   SP:  init std 1/sqrt(fan_in) (embedding 1), LR multiplier 1 and forward multiplier 1
//        everywhere: one global LR, as a plain AdamW run.
// Weight decay is decoupled (see Optimizer): matrices and embeddings decay (multiplier 1),
// norm gains do not (0), in both parameterizations.
#pragma once
#include <string>
#include <vector>

#include "train/model_config.hpp"

namespace moka::train {

enum class Parameterization : uint8_t { sp, mup };
const char* to_string(Parameterization p);
Parameterization parse_parameterization(const std::string& name);  // "sp" | "mup"

struct TensorRule {
  TensorSpec spec;
  bool fan_in_grows = false, fan_out_grows = false;
  double width_ratio = 1.0;  // m_in = fan_in / base fan_in (1 for norm gains)
  bool init_ones = false;    // norm gains start at 1; everything else N(0, init_std^2)
  double init_std = 0.0;
  double lr_multiplier = 1.0;
  double forward_multiplier = 1.0;  // scales the tensor's matmul output
  double weight_decay_multiplier = 1.0;
};

// One rule per tensor of `target`, in tensor_layout order. Throws when base and target differ
// in anything width scaling does not change (depth, top-k, head_dim, ranks, expert size).
std::vector<TensorRule> parameterize(const ModelConfig& base, const ModelConfig& target, Parameterization p);

}  // namespace moka::train
