#include "option_checks.hpp"

#include <unistd.h>

#include <cstdio>

#include "moka/error.hpp"

namespace moka::cli {
namespace {

std::string gibibytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", bytes / double(1 << 30));
  return text;
}

}  // namespace

CLI::Validator gini_range() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        double g = 0;
        if (!CLI::detail::lexical_cast(value, g) || !(g >= 0 && g < 1)) return "Value " + value + " not in [0, 1)";
        return {};
      },
      "in [0, 1)");
}

void require_host_memory(double bytes, const std::string& option, const std::string& use) {
  const double physical = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  require(physical <= 0 || bytes <= physical, ErrorCode::invalid_argument,
          option + " needs about " + gibibytes(bytes) + " of memory for " + use + ", more than this machine's " +
              gibibytes(physical));
}

}  // namespace moka::cli
