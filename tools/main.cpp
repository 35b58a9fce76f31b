// The `moka` command-line tool.
#include <iostream>
#include <string>

#include "commands.hpp"
#include "moka/error.hpp"
#include "moka/moka.hpp"

int main(int argc, char** argv) {
  CLI::App app{"moka: Mixture-of-Experts layers for NVLink-connected Hopper GPUs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("moka ") + MOKA_VERSION + " (commit " + moka::build_commit() + ")");
  app.option_defaults()->always_capture_default();  // --help shows every option's default
  moka::cli::set_command_line(argc, argv);
  moka::cli::register_bench(app);
  moka::cli::register_launch(app);
  moka::cli::register_simulate(app);
  moka::cli::register_train(app);
  moka::cli::register_coordcheck(app);
  moka::cli::register_lr_sweep(app);
  moka::cli::register_lr_horizon(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const moka::Error& e) {
    std::cerr << "moka: " + std::string(e.what()) + "\n";  // one write: worker processes share stderr
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moka: " + std::string(e.what()) + "\n";
    return 3;
  }
  return 0;
}
