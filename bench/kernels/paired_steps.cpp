// paired_steps: holds one case on the GPU (the tensors and routing of `moka bench --backend
// cuda`'s single-GPU row), prints "ready" after the warm-up, then times one forward+backward for
// every "step" line read from stdin and prints its milliseconds. bench/torch_baseline.py
// --paired-with (and bench/python_overhead.py) drive it, alternating these runs with their own,
// so that each moka/torch ratio compares two runs made moments apart on the same GPU. The layer's
// outputs are those `moka bench` checks; this harness only times.
#include <iomanip>
#include <iostream>

#include "kernel_lab.hpp"

namespace moka::lab {
namespace {

struct Options {
  std::string shape = "qwen3-30b-a3b";
  int64_t tokens = 16384;
  int warmup = 1;
  uint64_t seed = 1;
  std::string save = "gate_up";
};

void serve(const Options& o, std::istream& in, std::ostream& out) {
  const MoeShape& sh = named_shape(o.shape).shape;
  const cli::CaseStream stream("paired_steps");
  cli::LayerTensors t(sh, o.tokens);
  t.randomize_uniform(o.seed);
  LayerOptions lo;
  lo.save = parse_save_mode(o.save);
  auto layer = make_moe_layer(sh, Backend::cuda, nullptr, lo);
  auto step = [&] {
    auto c = layer->forward(t.inputs(), t.weights(), t.out_view(), Stream{stream.s});
    layer->backward(*c, t.d_out_view(), t.weights(), t.gradients(), Stream{stream.s});
  };
  for (int i = 0; i < o.warmup; ++i) step();
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  layer->check_errors();
  out << "ready" << std::endl;
  std::string line;
  while (std::getline(in, line) && line == "step")
    out << std::setprecision(9) << cli::time_ms(step, 0, 1, stream.s) << std::endl;
  layer->check_errors();
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  Options o;
  CLI::App app{"Hold one CUDA layer case and time one forward+backward per 'step' line on stdin", "paired_steps"};
  app.add_option("--shape", o.shape, "Named shape");
  app.add_option("--tokens", o.tokens, "Tokens")->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--warmup", o.warmup, "Untimed steps before 'ready'")->check(CLI::Range(0, 1000000));
  app.add_option("--seed", o.seed, "Random seed");
  app.add_option("--save", o.save, "What a forward keeps for its backward: gate_up | none")
      ->check(CLI::IsMember({"gate_up", "none"}));
  return lab_main(app, argc, argv, [&] { serve(o, std::cin, std::cout); });
}
