// Checks shared by the subcommands' options, with messages that name the option.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

namespace moka::cli {

// A load Gini: a number in [0, 1).
CLI::Validator gini_range();

// A finite number in [lo, hi], for every floating-point option: CLI::Range lets NaN through
// (every comparison with it is false), and a NaN option then gives NaN results, or undefined
// behaviour where it is converted to an integer (a duration).
CLI::Validator finite_range(double lo, double hi);

// Refuses, naming `option`, a run whose `bytes` of host memory (what `use` needs) exceed this
// machine's physical memory, before anything is allocated.
void require_host_memory(double bytes, const std::string& option, const std::string& use);

// Fails fast, naming `option`, unless `path` can be written: its directory exists and is
// writable and it is not itself a directory. Every option naming an output file is checked so
// before the work starts.
void check_output_path(const std::string& option, const std::string& path);

}  // namespace moka::cli
