#include "option_checks.hpp"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <functional>

#include "moka/error.hpp"

namespace moka::cli {
namespace {

std::string gibibytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", bytes / double(1 << 30));
  return text;
}

std::string number_text(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.15g", v);
  return text;
}

// A number for which `ok` holds, described (in --help and in the error) as `in_what`. Every `ok`
// is a conjunction of comparisons, which NaN fails.
CLI::Validator number_check(std::function<bool(double)> ok, const std::string& in_what) {
  return CLI::Validator(
      [ok, in_what](std::string& value) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(value, v) || !ok(v)) return "Value " + value + " not " + in_what;
        return {};
      },
      in_what);
}

}  // namespace

CLI::Validator gini_range() {
  return number_check([](double g) { return g >= 0 && g < 1; }, "in [0, 1)");
}

CLI::Validator finite_range(double lo, double hi) {
  // Infinity is outside a finite [lo, hi], and NaN fails both comparisons.
  return number_check([lo, hi](double v) { return v >= lo && v <= hi; },
                      "a finite number in [" + number_text(lo) + ", " + number_text(hi) + "]");
}

void require_host_memory(double bytes, const std::string& option, const std::string& use) {
  const double physical = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  require(physical <= 0 || bytes <= physical, ErrorCode::invalid_argument,
          option + " needs about " + gibibytes(bytes) + " of memory for " + use + ", more than this machine's " +
              gibibytes(physical));
}

void check_output_path(const std::string& option, const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path file(path);
  const fs::path dir = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  const std::string what = option + " " + path;
  std::error_code ec;
  require(!path.empty(), ErrorCode::invalid_argument, option + " needs a file name");
  require(fs::is_directory(dir, ec), ErrorCode::invalid_argument,
          what + ": directory " + dir.string() + " does not exist");
  require(::access(dir.c_str(), W_OK) == 0, ErrorCode::invalid_argument,
          what + ": directory " + dir.string() + " is not writable");
  require(!fs::is_directory(file, ec), ErrorCode::invalid_argument, what + " is a directory");
  require(!fs::exists(file, ec) || ::access(path.c_str(), W_OK) == 0, ErrorCode::invalid_argument,
          what + " is not writable");
}

}  // namespace moka::cli
