#include "train_options.hpp"

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace moka::cli {

void add_train_options(CLI::App* cmd, TrainCliOptions& o) {
  auto& b = o.base;
  b.d_model = 32;
  b.num_heads = 2;
  b.q_rank = b.kv_rank = 16;
  b.dense_intermediate = 64;
  b.num_experts = 4;
  o.train.batch = 4;
  o.train.seq = 32;
  cmd->add_option("--d-model", b.d_model, "base (x1) model width")->capture_default_str();
  cmd->add_option("--heads", b.num_heads, "base attention heads")->capture_default_str();
  cmd->add_option("--head-dim", b.head_dim, "head dimension (fixed as width grows)")->capture_default_str();
  cmd->add_option("--attention", o.attention, "mla | mha")->capture_default_str();
  cmd->add_option("--q-rank", b.q_rank, "MLA query latent rank")->capture_default_str();
  cmd->add_option("--kv-rank", b.kv_rank, "MLA key/value latent rank")->capture_default_str();
  cmd->add_option("--layers", b.num_layers, "layers (the first has a dense FFN)")->capture_default_str();
  cmd->add_option("--dense-intermediate", b.dense_intermediate, "dense FFN size of layer 0")->capture_default_str();
  cmd->add_option("--experts", b.num_experts, "base routed experts")->capture_default_str();
  cmd->add_option("--top-k", b.top_k, "experts per token")->capture_default_str();
  cmd->add_option("--expert-intermediate", b.expert_intermediate, "expert FFN size")->capture_default_str();
  cmd->add_option("--shared", b.shared_intermediate, "shared expert size (0 = none)")->capture_default_str();
  cmd->add_option("--z-loss", b.z_loss_coef, "router z-loss coefficient")->capture_default_str();
  cmd->add_option("--param", o.parameterization, "sp | mup")->capture_default_str();
  cmd->add_option("--lr", o.train.adam.lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--weight-decay", o.train.adam.weight_decay, "decoupled weight decay")->capture_default_str();
  cmd->add_option("--clip", o.train.adam.clip_norm, "max gradient norm (0 = off)")->capture_default_str();
  cmd->add_option("--steps", o.steps, "optimizer steps")->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "warmup steps")->capture_default_str();
  cmd->add_option("--schedule", o.schedule, "constant | wsd | cosine")->capture_default_str();
  cmd->add_option("--decay-fraction", o.train.schedule.decay_fraction, "WSD: share of steps decaying")
      ->capture_default_str();
  cmd->add_option("--min-lr-ratio", o.train.schedule.min_ratio, "final LR / peak LR")->capture_default_str();
  cmd->add_option("--batch", o.train.batch, "sequences per step")->capture_default_str();
  cmd->add_option("--seq", o.train.seq, "tokens per sequence")->capture_default_str();
  cmd->add_option("--bias-rate", o.train.bias_update_rate, "aux-loss-free balancing rate")->capture_default_str();
  cmd->add_option("--ema", o.train.ema_decay, "EMA decay of the weights (0 = off)")->capture_default_str();
  cmd->add_option("--seed", o.train.seed, "init and data seed")->capture_default_str();
  cmd->add_option("--threads", o.train.threads, "CPU threads per run")->capture_default_str();
  cmd->add_option("--backend", o.backend, "cpu | cuda")->capture_default_str();
  cmd->add_option("--data", o.data_dir, "fortune text folder (default: $MOKA_TEXT_DIR or the fortunes package)");
  cmd->add_option("--max-bytes", o.max_bytes, "load only this much text (0 = all)")->capture_default_str();
}

train::TrainConfig TrainCliOptions::resolve(int64_t multiplier) {
  train::TrainConfig t = train;
  t.backend = parse_backend(backend);
  require(t.backend != Backend::automatic, ErrorCode::invalid_argument, "--backend is cpu or cuda");
  require(attention == "mla" || attention == "mha", ErrorCode::invalid_argument, "--attention is mla or mha");
  t.base = base;
  t.base.attention = attention == "mla" ? train::AttentionKind::mla : train::AttentionKind::mha;
  t.model = train::scale_width(t.base, multiplier);
  t.parameterization = train::parse_parameterization(parameterization);
  t.schedule.kind = train::parse_schedule(schedule);
  t.schedule.total_steps = steps;
  t.schedule.warmup_steps = warmup;
  return t;
}

train::TextSplit TrainCliOptions::load_text() const {
  return train::load_fortune_corpus(data_dir.empty() ? train::default_text_dir() : data_dir, max_bytes);
}

void draw_plot(const std::string& kind, const std::string& csv, const std::string& png) {
  const char* python = std::getenv("MOKA_PYTHON");
  const std::string cmd = std::string(python && *python ? python : "/usr/bin/python3") + " '" MOKA_PLOT_SCRIPT "' " +
                          kind + " '" + csv + "' '" + png + "'";
  if (std::system(cmd.c_str()) != 0)
    std::cerr << "moka: plotting failed (needs python3 with matplotlib; set MOKA_PYTHON): " << cmd << "\n";
}

std::vector<int64_t> parse_multipliers(const std::string& list) {
  std::vector<int64_t> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoll(item));
  require(!out.empty(), ErrorCode::invalid_argument, "empty width multiplier list");
  return out;
}

}  // namespace moka::cli
