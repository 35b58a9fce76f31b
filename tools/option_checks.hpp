// Checks shared by the subcommands' options, with messages that name the option.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

namespace moka::cli {

// A load Gini: a number in [0, 1).
CLI::Validator gini_range();

// Refuses, naming `option`, a run whose `bytes` of host memory (what `use` needs) exceed this
// machine's physical memory, before anything is allocated.
void require_host_memory(double bytes, const std::string& option, const std::string& use);

}  // namespace moka::cli
