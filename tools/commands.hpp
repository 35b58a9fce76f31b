// Each `moka` subcommand registers itself on the CLI11 app.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "moka/process_group.hpp"

namespace moka::cli {

void register_bench(CLI::App& app);
void register_launch(CLI::App& app);

// The command line moka was started with (argv[0] first), to re-run it in worker processes.
const std::vector<std::string>& command_line();
void set_command_line(int argc, char** argv);
std::string self_executable();
// `--gpus N` outside a worker: runs N workers of this same command line, waits for them and
// returns true (the caller is done); false inside a worker or for N <= 1.
bool ran_as_workers(int gpus, const std::string& what);
// Inside a worker process: joins the workers' TCP group (after selecting the GPU of this local
// rank when `on_gpu`); null outside one.
std::unique_ptr<ProcessGroup> join_workers(bool on_gpu);
void register_simulate(CLI::App& app);
void register_train(CLI::App& app);
void register_coordcheck(CLI::App& app);
void register_lr_sweep(CLI::App& app);
void register_lr_horizon(CLI::App& app);

}  // namespace moka::cli
