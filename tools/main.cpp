// The `moka` command-line tool.
#include <iostream>
#include <string>

#include "commands.hpp"
#include "moka/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"moka: Mixture-of-Experts layers for NVLink-connected Hopper GPUs"};
  app.require_subcommand(1);
  moka::cli::set_command_line(argc, argv);
  moka::cli::register_bench(app);
  moka::cli::register_launch(app);
  moka::cli::register_simulate(app);
  moka::cli::register_train(app);
  moka::cli::register_coordcheck(app);
  moka::cli::register_lr_sweep(app);
  moka::cli::register_tune(app);
  moka::cli::register_incast(app);
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
