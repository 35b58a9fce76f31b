// Fuzzing the checkpoint reader (read_safetensors) with deterministic mutations of a file
// write_safetensors wrote: a flipped bit anywhere, replaced bytes, hostile header lengths and
// header fields, deep nesting, and files that are no checkpoint at all. Each is read back as
// written or refused with an io error naming the file; a single flipped bit always refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "reader_fuzz.hpp"
#include "train/checkpoint.hpp"

using namespace moka::train;
using namespace moka::testing;

namespace {

// Two dtypes, an empty tensor and metadata: what a training checkpoint holds, in small.
SafetensorsFile written_file() {
  SafetensorsFile f;
  f.put("w", std::vector<float>{1.5f, -2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  f.put("bias", std::vector<double>{0.25, -8.0}, {2});
  f.put("none", std::vector<float>{}, {0, 4});
  f.metadata["step"] = "7";
  return f;
}

// The file's 8-byte header length, header text and data section, put back together with the
// header's length field following the text.
struct FileParts {
  std::string header, data;

  explicit FileParts(const std::string& bytes) {
    uint64_t length = 0;
    std::memcpy(&length, bytes.data(), sizeof(length));
    header = bytes.substr(sizeof(length), length);
    data = bytes.substr(sizeof(length) + length);
  }
  // The file with the header's first `from` (which must occur) replaced by `to`.
  std::string with_header_edit(const std::string& from, const std::string& to) const {
    std::string edited = header;
    const size_t at = edited.find(from);
    EXPECT_NE(at, std::string::npos) << from << " in " << header;
    return with_header(at == std::string::npos ? edited : edited.replace(at, from.size(), to));
  }
  std::string with_header(const std::string& text) const { return with_length(text.size(), text); }
  std::string with_length(uint64_t length, const std::string& text) const {
    return std::string(reinterpret_cast<const char*>(&length), sizeof(length)) + text + data;
  }
};

class CheckpointFuzz : public ScratchFolder {
 protected:
  void SetUp() override {
    ScratchFolder::SetUp();
    write_safetensors(path("written.safetensors"), written_file());
    bytes_ = read_bytes(path("written.safetensors"));
  }

  ReadOutcome<SafetensorsFile> read(const std::string& bytes, const std::string& mutation) {
    return read_outcome(read_safetensors, write("mutated.safetensors", bytes), mutation);
  }
  // Refused as an io error whose message holds `reason`.
  void expect_refused(const std::string& bytes, const std::string& reason, const std::string& mutation) {
    const auto outcome = read(bytes, mutation);
    const bool refused = !outcome.value && outcome.code == moka::ErrorCode::io;
    EXPECT_TRUE(refused && outcome.error.find(reason) != std::string::npos)
        << mutation << ": expected '" << reason << "' in: " << outcome.error;
  }

  std::string bytes_;  // the file as written
};

// What the reader promises of a file it reads: the content as written, every tensor's name,
// dtype, shape and bytes, and the metadata (all of it under checksums).
void expect_written_content(const SafetensorsFile& read, const SafetensorsFile& written, const std::string& mutation) {
  EXPECT_EQ(read.metadata, written.metadata) << mutation;
  ASSERT_EQ(read.tensors.size(), written.tensors.size()) << mutation;
  for (const auto& [name, tensor] : written.tensors) {
    ASSERT_TRUE(read.tensors.count(name)) << mutation << ": no tensor " << name;
    const StoredTensor& t = read.get(name);
    EXPECT_EQ(t.bytes, tensor.bytes) << mutation << ": tensor " << name;
    EXPECT_EQ(t.dtype, tensor.dtype) << mutation << ": tensor " << name;
    EXPECT_EQ(t.shape, tensor.shape) << mutation << ": tensor " << name;
  }
}

// Where byte `at` of the written file lies, for failure messages: the header length, the header
// text (with the characters around it), its padding, or the data section.
std::string region_of(const FileParts& parts, size_t at) {
  constexpr size_t kLengthBytes = sizeof(uint64_t);
  const size_t padding = kLengthBytes + parts.header.find_last_not_of(' ') + 1;
  if (at < kLengthBytes) return "the header length";
  if (at < padding) {
    const size_t around = std::max(at, kLengthBytes + 12) - kLengthBytes - 12;
    return "the header text at ..." + parts.header.substr(around, 24) + "...";
  }
  if (at < kLengthBytes + parts.header.size()) return "the header's padding";
  return "the data section";
}

}  // namespace

// The file unharmed reads back whole, the empty tensor too (whose bytes' data() is null: UBSan
// once caught it passed to memcpy).
TEST_F(CheckpointFuzz, TheWrittenFileReadsBack) {
  const auto read = read_safetensors(path("written.safetensors"));
  expect_written_content(read, written_file(), "unharmed");
  EXPECT_EQ(read.get("w").as<float>(), (std::vector<float>{1.5f, -2.f, 3.f, 4.f, 5.f, 6.f}));
  EXPECT_TRUE(read.get("none").as<float>().empty());
}

// Every single-bit flip anywhere in the file, in every region (the header length, each tensor's
// name, dtype, shape and offsets, the metadata, the checksums, the padding, the data): refused.
TEST_F(CheckpointFuzz, EveryFlippedBitIsRefused) {
  const FileParts parts(bytes_);
  ASSERT_EQ(region_of(parts, bytes_.size() - 1), "the data section");
  ASSERT_EQ(region_of(parts, sizeof(uint64_t) + parts.header.size() - 1), "the header's padding")
      << "the written file's header has no padding to flip; change a metadata value's length";
  for (size_t at = 0; at < bytes_.size(); ++at)
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = bytes_;
      flipped[at] = static_cast<char>(static_cast<uint8_t>(flipped[at]) ^ (1u << bit));
      const std::string mutation =
          "bit " + std::to_string(bit) + " of byte " + std::to_string(at) + " (" + region_of(parts, at) + ")";
      EXPECT_FALSE(read(flipped, mutation).value) << mutation << " was read back";
    }
}

TEST_F(CheckpointFuzz, ReplacedBytesAreRefusedOrReadTheWrittenContent) {
  const auto written = written_file();
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::string bytes = bytes_;
    for (int replaced = 1 + int(rng() % 3); replaced > 0; --replaced)
      bytes = with_byte_replaced(bytes, rng() % bytes.size(), rng);
    const std::string mutation = "trial " + std::to_string(trial);
    const auto outcome = read(bytes, mutation);
    if (outcome.value) expect_written_content(*outcome.value, written, mutation);
  }
}

TEST_F(CheckpointFuzz, HostileHeaderLengthsAreRefused) {
  const FileParts parts(bytes_);
  const uint64_t length = parts.header.size(), file_size = bytes_.size();
  for (uint64_t hostile : {uint64_t{0}, uint64_t{1}, uint64_t{7}, length - 1, length + 1, length + 8, file_size - 8,
                           file_size - 7, file_size, uint64_t{1} << 32, uint64_t{1} << 63, ~uint64_t{0}}) {
    const auto outcome = read(parts.with_length(hostile, parts.header), "header length " + std::to_string(hostile));
    EXPECT_FALSE(outcome.value) << "header length " << hostile;
  }
}

// Every field of a tensor's entry given a value it cannot take: refused naming the tensor (or as
// not JSON, for NaN and the like).
TEST_F(CheckpointFuzz, HostileTensorFieldsAreRefusedNamingTheTensor) {
  const FileParts parts(bytes_);
  const std::string entry = R"("w":{"data_offsets":[16,40],"dtype":"F32","shape":[2,3]})";
  // `entry` with its first `from` as `to`.
  const auto edited = [&](const std::string& from, const std::string& to) {
    return std::string(entry).replace(entry.find(from), from.size(), to);
  };
  for (const auto& value : kHostileJsonValues)
    for (const std::string& hostile_entry :
         {edited("[2,", "[" + value + ","), edited(",3]", "," + value + "]"), edited("[16,", "[" + value + ","),
          edited(",40]", "," + value + "]"), edited(R"("F32")", value), edited("[2,3]", value),
          edited("[16,40]", value), edited(entry.substr(4), value)}) {
      const auto outcome = read(parts.with_header_edit(entry, hostile_entry), hostile_entry);
      const bool named = outcome.error.find("tensor 'w'") != std::string::npos ||
                         outcome.error.find("its header is not JSON") != std::string::npos;
      EXPECT_TRUE(!outcome.value && named) << hostile_entry << ": " << outcome.error;
    }
}

// Fractions were once truncated: a shape [2.0, 3] or [6.5] read as [2, 3] or [6].
TEST_F(CheckpointFuzz, ShapesWithFractionsOrFloatsAreRefused) {
  const FileParts parts(bytes_);
  for (const std::string shape : {"[2.0,3]", "[2,3.0]", "[2e0,3]", "[6.5]", "[true,6]", "[2,3,1.0]"})
    expect_refused(parts.with_header_edit("[2,3]", shape),
                   "tensor 'w' needs dtype, shape and data_offsets (its shape must be a list of non-negative integers)",
                   "shape " + shape);
  expect_refused(parts.with_header_edit("[16,40]", "[16.0,40]"), "data_offsets must be [begin, end]", "offsets");
  expect_refused(parts.with_header_edit("[16,40]", "[16,4e1]"), "data_offsets must be [begin, end]", "offsets");
}

TEST_F(CheckpointFuzz, DeepNestingIsRefusedWithoutOverflowingTheStack) {
  const FileParts parts(bytes_);
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_refused(parts.with_header_edit("[2,3]", deep), "tensor 'w' needs", "deep shape");
  expect_refused(parts.with_header_edit(R"("w":{)", R"("w":)" + deep + R"(,"x":{)"), "tensor 'w' needs", "deep entry");
  expect_refused(parts.with_header_edit(R"("__metadata__":{)", R"("__metadata__":{"deep":)" + deep + ","),
                 "__metadata__ entry 'deep' is not a string", "deep metadata");
  expect_refused(parts.with_header(deep), "its header is not a JSON object", "deep header");
}

TEST_F(CheckpointFuzz, FilesThatHoldNoCheckpointAreRefused) {
  expect_refused("", "fewer than the 8-byte header length", "an empty file");
  expect_refused(std::string(8, '\0'), "its header is not JSON", "a zero header length");
  expect_refused(std::string(64, '\xff'), "runs past the end", "0xff bytes");
  expect_refused("{}", "fewer than the 8-byte header length", "two bytes");
  const auto folder = path("a_folder.safetensors");
  std::filesystem::create_directory(folder);
  const auto outcome = read_outcome(read_safetensors, folder, "a folder");
  EXPECT_NE(outcome.error.find(folder + " is a directory"), std::string::npos) << outcome.error;
  EXPECT_FALSE(read_outcome(read_safetensors, path("missing.safetensors"), "a missing file").value);
}
