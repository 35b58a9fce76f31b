#include "train/text_data.hpp"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "moka/error.hpp"

namespace moka::train {
namespace fs = std::filesystem;

std::string default_text_dir() {
  const char* env = std::getenv("MOKA_TEXT_DIR");
  return env && *env ? env : "/usr/share/games/fortunes";
}

namespace {

std::vector<std::string> fortune_files(const std::string& dir) {
  require(fs::is_directory(dir), ErrorCode::io,
          "text folder " + dir + " not found (run scripts/fetch_data.sh, or set MOKA_TEXT_DIR)");
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_symlink() || !entry.is_regular_file() || entry.path().extension() == ".dat") continue;
    files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  require(!files.empty(), ErrorCode::io, "no fortune files in " + dir);
  return files;
}

// Calls take(record) for each record of `in` (records end at a line "%"), reading no further
// than the record that makes take return false.
void for_each_record(std::istream& in, const std::function<bool(std::string&)>& take) {
  std::string line, record;
  while (std::getline(in, line)) {
    if (line == "%") {
      if (!record.empty() && !take(record)) return;
      record.clear();
    } else {
      record += line + "\n";
    }
  }
  if (!record.empty()) take(record);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

TextSplit load_fortune_corpus(const std::string& dir, int64_t max_bytes, int validation_every) {
  require(validation_every >= 2, ErrorCode::invalid_argument, "validation_every must be >= 2");
  TextSplit split;
  int64_t loaded = 0;
  for (const auto& path : fortune_files(dir)) {
    std::ifstream in(path, std::ios::binary);
    require(bool(in), ErrorCode::io, "cannot read " + path);
    split.files.push_back(path);
    // Record by record: with max_bytes, reading stops at the record that reaches it.
    bool full = false;
    for_each_record(in, [&](std::string& record) {
      auto& dst = fnv1a(record) % uint64_t(validation_every) == 0 ? split.validation : split.train;
      record += "\n";
      dst.insert(dst.end(), record.begin(), record.end());
      ++split.records;
      loaded += int64_t(record.size());
      full = max_bytes > 0 && loaded >= max_bytes;
      return !full;
    });
    if (full) return split;
  }
  return split;
}

Batch sample_batch(const std::vector<uint8_t>& text, int64_t batch, int64_t seq, uint64_t seed, int64_t step) {
  // Written so that no value of batch or seq overflows (seq + 1 or batch * seq would).
  const std::string sizes = "a batch of " + std::to_string(batch) + " x " + std::to_string(seq) + " tokens";
  require(batch >= 1 && seq >= 1, ErrorCode::invalid_argument, sizes + ": both must be positive");
  require(int64_t(text.size()) - 1 > seq, ErrorCode::invalid_argument,
          "text of " + std::to_string(text.size()) + " bytes is shorter than a sequence of " + std::to_string(seq));
  int64_t tokens = 0;
  require(!__builtin_mul_overflow(batch, seq, &tokens), ErrorCode::invalid_argument, sizes + " overflows 64 bits");
  Batch b{batch, seq, std::vector<int32_t>(size_t(tokens)), std::vector<int32_t>(size_t(tokens))};
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + uint64_t(step));
  std::uniform_int_distribution<int64_t> offset(0, int64_t(text.size()) - seq - 1);
  for (int64_t s = 0; s < batch; ++s) {
    const int64_t o = offset(rng);
    for (int64_t t = 0; t < seq; ++t) {
      b.inputs[s * seq + t] = text[o + t];
      b.targets[s * seq + t] = text[o + t + 1];
    }
  }
  return b;
}

}  // namespace moka::train
