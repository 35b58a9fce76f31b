// Each `moka` subcommand registers itself on the CLI11 app.
#pragma once
#include <CLI/CLI.hpp>

namespace moka::cli {

void register_bench(CLI::App& app);
void register_train(CLI::App& app);
void register_coordcheck(CLI::App& app);
void register_lr_sweep(CLI::App& app);

}  // namespace moka::cli
