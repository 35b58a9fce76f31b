// Shared pieces of the file readers' fuzz tests (routing dumps, checkpoints): a scratch folder,
// deterministic mutations of a valid file, and the two outcomes a reader may have for each: the
// data, or a moka::Error whose message names the file. Any other exception, a crash, a hang or an
// allocation out of proportion to the file fails (CI runs them under ASan and UBSan too).
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "moka/error.hpp"

namespace moka::testing {

// Numbers and values that no count, length, offset or id of a file may take, as JSON text (the
// first ones are not JSON at all). Zero is left out: an expert id or a byte offset may be 0.
// A table, several values a line (clang-format would put one a line).
// clang-format off
inline const std::vector<std::string> kHostileJsonValues = {
    "NaN", "Infinity", "-Infinity", "nan", "0x10", "-1", "-9223372036854775808", "9223372036854775807",
    "9223372036854775808", "18446744073709551615", "99999999999999999999999", "1e308", "-1e308", "1e999",
    "2.5", "1e2", "\"2\"", "null", "true", "[]", "{}", "[[[[1]]]]"};
// clang-format on

// A test with a fresh folder, removed with everything in it when the test ends.
class ScratchFolder : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (std::filesystem::temp_directory_path() / "moka_fuzz_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    folder_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(folder_); }

  std::string path(const std::string& name) const { return (folder_ / name).string(); }
  // Writes `bytes` to the file `name` of the folder, returning its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    const auto file = path(name);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    return file;
  }

 private:
  std::filesystem::path folder_;
};

inline std::string read_bytes(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// `bytes` with the byte at `at` changed to another value drawn from `rng`.
inline std::string with_byte_replaced(std::string bytes, size_t at, std::mt19937& rng) {
  bytes[at] = static_cast<char>(static_cast<uint8_t>(bytes[at]) ^ static_cast<uint8_t>(1 + rng() % 255));
  return bytes;
}

// `bytes` with one bit, drawn from `rng`, of the byte at `at` flipped.
inline std::string with_bit_flipped(std::string bytes, size_t at, std::mt19937& rng) {
  bytes[at] = static_cast<char>(static_cast<uint8_t>(bytes[at]) ^ static_cast<uint8_t>(1u << (rng() % 8)));
  return bytes;
}

// What a reader made of a file: its value, or the moka::Error it refused the file with (whose
// message must name the file; `mutation` says in a failure which input it was).
template <typename T>
struct ReadOutcome {
  std::optional<T> value;
  std::string error;
  std::optional<ErrorCode> code;
};

template <typename Reader>
auto read_outcome(const Reader& read, const std::string& file, const std::string& mutation)
    -> ReadOutcome<decltype(read(file))> {
  try {
    return {read(file), {}, std::nullopt};
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(file), std::string::npos) << mutation << ": the message does not name the file: " << what;
    return {std::nullopt, what, e.code()};
  } catch (const std::exception& e) {
    ADD_FAILURE() << mutation << ": escaped as another exception than moka::Error: " << e.what();
    return {std::nullopt, e.what(), std::nullopt};
  }
}

}  // namespace moka::testing
