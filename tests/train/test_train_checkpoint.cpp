// Checkpoints: the safetensors reader refuses truncated and corrupted files with an error naming
// the file (never a crash or an oversized allocation), checksums catch flipped bits that leave the
// file well-formed, a killed writer never tears the previous checkpoint, and resuming refuses a
// checkpoint of another run.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/checkpoint.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;
using moka::train::testing::tiny_train_config;
namespace fs = std::filesystem;

namespace {

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "moka_checkpoint_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A file of the given header length, header text and data bytes.
  std::string write_raw(const std::string& header, const std::string& data, uint64_t header_length) const {
    const auto p = path("raw.safetensors");
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&header_length), sizeof(header_length));
    out << header << data;
    return p;
  }
  std::string write_raw(const std::string& header, const std::string& data) const {
    return write_raw(header, data, header.size());
  }

  static SafetensorsFile sample() {
    SafetensorsFile f;
    f.put("w", std::vector<float>{1.5f, -2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
    f.put("b", std::vector<double>{0.25}, {1});
    f.metadata["step"] = "7";
    return f;
  }

  fs::path dir_;
};

// read_safetensors(file) throws an io error naming the file and containing `reason`.
void expect_refused(const std::string& file, const std::string& reason) {
  try {
    read_safetensors(file);
    ADD_FAILURE() << "read " << file << " although it is corrupt (" << reason << ")";
  } catch (const moka::Error& e) {
    EXPECT_EQ(e.code(), moka::ErrorCode::io) << e.what();
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  }
}

std::string read_bytes(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_F(Checkpoint, EveryTruncationIsRefused) {
  const auto whole_file = path("whole.safetensors");
  write_safetensors(whole_file, sample());
  const std::string bytes = read_bytes(whole_file);
  const auto cut = path("cut.safetensors");
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::ofstream(cut, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(n));
    EXPECT_THROW(read_safetensors(cut), moka::Error) << "truncated to " << n << " of " << bytes.size() << " bytes";
  }
  expect_refused(cut, "outside the");  // the last cut drops one data byte
}

TEST_F(Checkpoint, HeaderLengthPastTheEndIsRefusedBeforeAllocating) {
  expect_refused(write_raw("{}", "", uint64_t(1) << 60), "runs past the end");
  expect_refused(write_raw("", ""), "its header is not JSON");
  std::ofstream(path("short.safetensors")) << "abc";
  expect_refused(path("short.safetensors"), "fewer than the 8-byte header length");
}

TEST_F(Checkpoint, ByteCountMustMatchDtypeTimesShape) {
  // Five bytes for one F32: the reader once copied them into a four-byte buffer.
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,5]}})", "12345"),
                 "tensor 'w' holds 5 bytes, but F32 [1] needs 4");
  expect_refused(write_raw(R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", "12345678"), "needs 16");
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[1099511627776,1099511627776,16],)"
                           R"("data_offsets":[0,4]}})",
                           "1234"),
                 "more than 2^64");
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "1234"), "needs");
  expect_refused(write_raw(R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", "1234"),
                 "dtype F16, which moka does not read");
}

TEST_F(Checkpoint, OffsetsMustLieInsideTheFileWithoutOverlap) {
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,1000]}})", "12345678"),
                 "tensor 'w' at bytes [0, 1000) lies outside the 8-byte data section");
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", "12345678"), "lies outside");
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", "12345678"), "lies outside");
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "1234"),
                 "data_offsets must be [begin, end]");
  expect_refused(write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           "123456789012"),
                 "tensors 'a' and 'b' overlap");
}

TEST_F(Checkpoint, MalformedHeadersAreRefusedNamingTheFile) {
  expect_refused(write_raw("{not json", ""), "its header is not JSON");
  expect_refused(write_raw("[1, 2]", ""), "its header is not a JSON object");
  expect_refused(write_raw(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", "1234"),
                 "tensor 'w' needs dtype, shape and data_offsets");
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":["one"],"data_offsets":[0,4]}})", "1234"),
                 "tensor 'w' needs dtype, shape and data_offsets");
  expect_refused(write_raw(R"({"w":7})", ""), "tensor 'w' needs");
  expect_refused(write_raw(R"({"__metadata__":{"step":7}})", ""), "__metadata__ entry 'step' is not a string");
  expect_refused(write_raw(R"({"__metadata__":[]})", ""), "__metadata__ is not an object");
}

// Random byte flips anywhere in a valid file: each read either succeeds or throws moka::Error.
TEST_F(Checkpoint, RandomCorruptionNeverEscapesAsAnotherError) {
  const auto whole_file = path("whole.safetensors");
  write_safetensors(whole_file, sample());
  const std::string bytes = read_bytes(whole_file);
  std::mt19937 rng(7);
  const auto damaged = path("damaged.safetensors");
  for (int trial = 0; trial < 300; ++trial) {
    std::string copy = bytes;
    for (int flips = 1 + int(rng() % 3); flips > 0; --flips) copy[rng() % copy.size()] = char(rng());
    std::ofstream(damaged, std::ios::binary | std::ios::trunc) << copy;
    try {
      read_safetensors(damaged);
    } catch (const moka::Error&) {
    } catch (const std::exception& e) {
      FAIL() << "trial " << trial << ": " << e.what();
    }
  }
}

namespace {

// The data-section offset of a file write_safetensors wrote.
uint64_t data_start(const std::string& bytes) {
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), sizeof(header_length));
  return sizeof(header_length) + header_length;
}

// `bytes` with one bit flipped at each of `count` positions spread over [begin, end), the last
// byte included, one copy per position.
std::vector<std::string> bit_flips(const std::string& bytes, uint64_t begin, uint64_t end, uint64_t count) {
  std::vector<std::string> out;
  for (uint64_t i = 0; i < count; ++i) {
    std::string copy = bytes;
    copy[begin + i * (end - 1 - begin) / (count - 1)] ^= char(1 << (i % 8));
    out.push_back(copy);
  }
  return out;
}

std::vector<std::string> data_bit_flips(const std::string& bytes) {
  return bit_flips(bytes, data_start(bytes), bytes.size(), 20);
}

}  // namespace

// Before checksums every one of these read back as different numbers, silently.
TEST_F(Checkpoint, EveryDataBitFlipIsRefusedAsAChecksumMismatch) {
  SafetensorsFile f = sample();
  f.put("big", std::vector<float>(1000, 0.5f), {1000});
  const auto whole_file = path("whole.safetensors");
  write_safetensors(whole_file, f);
  const auto flipped = path("flipped.safetensors");
  for (const auto& copy : data_bit_flips(read_bytes(whole_file))) {
    std::ofstream(flipped, std::ios::binary | std::ios::trunc) << copy;
    expect_refused(flipped, "checksum mismatch in tensor '");
  }
}

// Edits of the header that keep it well-formed and the byte counts right: before the header had
// a checksum, a shape [3,2] for [2,3] or I32 for F32 read back as written.
TEST_F(Checkpoint, HeaderIsChecksummedToo) {
  const auto file = path("ckpt.safetensors");
  write_safetensors(file, sample());
  const std::string bytes = read_bytes(file);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {R"("step":"7")", R"("step":"6")"}, {R"("shape":[2,3])", R"("shape":[3,2])"}, {R"("F32")", R"("I32")"}}) {
    std::string edited = bytes;
    const auto at = edited.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    std::ofstream(file, std::ios::binary | std::ios::trunc) << edited.replace(at, from.size(), to);
    expect_refused(file, "checksum mismatch in the header");
  }
}

// A well-formed header in other bytes than the writer's (here a space after its opening brace) is
// refused: every byte of the header is checked, not only what it means.
TEST_F(Checkpoint, HeaderMustBeTheWritersText) {
  const auto file = path("ckpt.safetensors");
  write_safetensors(file, sample());
  std::string bytes = read_bytes(file);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), sizeof(header_length));
  ++header_length;
  std::memcpy(bytes.data(), &header_length, sizeof(header_length));
  bytes.insert(sizeof(header_length) + 1, " ");
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  expect_refused(file, "its header is not byte for byte as moka writes it");
}

TEST_F(Checkpoint, RoundTripIsBitForBit) {
  SafetensorsFile f = sample();
  f.tensors["nan"] = StoredTensor{moka::DType::f32, {2}, {0x01, 0x00, 0xC0, 0x7F, 0x00, 0x00, 0x00, 0x80}};
  f.tensors["empty"] = StoredTensor{moka::DType::f64, {0, 3}, {}};
  const auto file = path("ckpt.safetensors"), again = path("again.safetensors");
  write_safetensors(file, f);
  const auto g = read_safetensors(file);
  EXPECT_EQ(g.metadata, f.metadata);  // the checksums are the reader's, not the caller's
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  for (const auto& [name, t] : f.tensors) {
    EXPECT_EQ(g.get(name).bytes, t.bytes) << name;
    EXPECT_EQ(g.get(name).shape, t.shape) << name;
    EXPECT_EQ(g.get(name).dtype, t.dtype) << name;
  }
  write_safetensors(again, g);
  EXPECT_EQ(read_bytes(again), read_bytes(file));
}

// CRC-32C test vectors of RFC 3720 B.4, as the file records them.
TEST_F(Checkpoint, ChecksumsAreCrc32c) {
  SafetensorsFile f;
  f.tensors["zeros"] = StoredTensor{moka::DType::f32, {8}, std::vector<uint8_t>(32, 0)};
  f.tensors["ones"] = StoredTensor{moka::DType::f32, {8}, std::vector<uint8_t>(32, 0xFF)};
  std::vector<uint8_t> ascending(32);
  for (size_t i = 0; i < ascending.size(); ++i) ascending[i] = uint8_t(i);
  f.tensors["ascending"] = StoredTensor{moka::DType::f32, {8}, ascending};
  const auto file = path("ckpt.safetensors");
  write_safetensors(file, f);
  const std::string bytes = read_bytes(file);
  for (const char* crc : {R"(\"zeros\":\"8a9136aa\")", R"(\"ones\":\"62a8ab43\")", R"(\"ascending\":\"46dd794e\")"})
    EXPECT_NE(bytes.find(crc), std::string::npos) << crc << " in " << bytes.substr(0, data_start(bytes));
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
}

TEST_F(Checkpoint, FilesWithoutChecksumsAreRefused) {
  expect_refused(write_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "1234"),
                 "its metadata has no moka.crc32c checksums");
  const auto with_metadata = [&](const std::string& metadata) {
    return write_raw(R"({"__metadata__":{"moka.checksum_format":"2",)" + metadata + "}}", "");
  };
  expect_refused(with_metadata(R"("moka.crc32c":"{}")"), "its metadata has no moka.header_crc32c");
  expect_refused(with_metadata(R"("moka.crc32c":"{}","moka.header_crc32c":"0000000g")"),
                 "checksum of the header is not eight lowercase hex digits");
  SafetensorsFile f = sample();
  f.metadata["moka.crc32c"] = "mine";
  EXPECT_THROW(write_safetensors(path("reserved.safetensors"), f), moka::Error);
}

namespace {

std::string crc_hex(const std::string& bytes) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc32c(bytes.data(), bytes.size()));
  return text;
}

// A file of one F32 tensor 'w' whose metadata holds `tensor_checksums` and a header checksum as
// the writer computes it: the header check passes, whatever the tensors' checksums say.
std::string header_checksummed(const std::string& tensor_checksums) {
  nlohmann::json header = {{"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}}};
  header["__metadata__"] = {{"moka.checksum_format", "2"}, {"moka.crc32c", tensor_checksums}};
  header["__metadata__"]["moka.header_crc32c"] = crc_hex(header.dump());
  std::string text = header.dump();
  return text.append((8 - text.size() % 8) % 8, ' ');
}

}  // namespace

TEST_F(Checkpoint, TensorChecksumsMustCoverEveryTensor) {
  const std::string data = "1234";
  const std::string good = R"({"w":")" + crc_hex(data) + R"("})";
  read_safetensors(write_raw(header_checksummed(good), data));  // the helper writes a valid file
  expect_refused(write_raw(header_checksummed("[]"), data), "its moka.crc32c checksums are not a JSON object");
  expect_refused(write_raw(header_checksummed(R"({"w":"0000000g"})"), data),
                 "checksum of 'w' is not eight lowercase hex digits");
  expect_refused(write_raw(header_checksummed("{}"), data), "tensor 'w' has no checksum");
  expect_refused(write_raw(header_checksummed(R"({"w":"00000000","v":"00000000"})"), data),
                 "it has checksums of tensors it does not hold");
  expect_refused(write_raw(header_checksummed(R"({"w":"00000000"})"), data), "checksum mismatch in tensor 'w'");
}

// Files of checksum format 1 (before the header had a checksum) are refused naming the format.
TEST_F(Checkpoint, OlderChecksumFormatIsRefusedNamingIt) {
  expect_refused(write_raw(R"({"__metadata__":{"moka.crc32c":"{\"__metadata__\":\"00000000\"}"}})", ""),
                 "its checksums are in moka's checksum format 1, which left the header unchecked; this moka reads "
                 "format 2 only");
  expect_refused(write_raw(R"({"__metadata__":{"moka.checksum_format":"3","moka.crc32c":"{}"}})", ""),
                 "its checksums are in moka's checksum format '3'; this moka reads format 2 only");
}

TEST_F(Checkpoint, TensorsHoldExactlyTheirShape) {
  const StoredTensor five_bytes{moka::DType::f32, {1}, {1, 2, 3, 4, 5}};
  EXPECT_THROW(five_bytes.as<float>(), moka::Error);
  SafetensorsFile f;
  EXPECT_THROW(f.put("w", std::vector<float>(5), {2, 3}), moka::Error);
}

TEST_F(Checkpoint, WritingLeavesOnlyTheFinishedFile) {
  const auto file = path("ckpt.safetensors");
  write_safetensors(file, sample());
  write_safetensors(file, sample());
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
  EXPECT_EQ(read_safetensors(file).get("w").as<float>(), sample().get("w").as<float>());
  try {
    write_safetensors(path("no/such/dir/ckpt.safetensors"), sample());
    FAIL() << "wrote into a missing directory";
  } catch (const moka::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no/such/dir/ckpt.safetensors"), std::string::npos) << e.what();
  }
}

// A writer killed at a random moment leaves the previous checkpoint or the new one, whole.
TEST_F(Checkpoint, KillDuringWriteKeepsAWholeCheckpoint) {
  const auto file = path("ckpt.safetensors");
  write_safetensors(file, sample());
  SafetensorsFile big;
  big.put("w", std::vector<float>(4 << 20, 1.0f), {4 << 20});
  for (int attempt = 0; attempt < 3; ++attempt) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      try {
        for (;;) write_safetensors(file, big);
      } catch (...) {
      }
      ::_exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + 70 * attempt));
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    const auto after = read_safetensors(file);  // throws on a torn file
    EXPECT_EQ(after.tensors.size(), after.tensors.count("w") + after.tensors.count("b"));
  }
  // The next save removes the temporaries the killed writers left.
  write_safetensors(file, sample());
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST(CheckpointResume, RefusesACheckpointOfAnotherRun) {
  MOKA_REQUIRE_CORPUS(text);
  const auto file = (fs::temp_directory_path() / "moka_resume_identity.safetensors").string();
  const auto config = tiny_train_config(Parameterization::mup, 1e-2);
  Trainer(config, *text).save(file);
  auto expect_load_fails = [&](TrainConfig other, const std::string& reason) {
    Trainer trainer(other, *text);
    try {
      trainer.load(file);
      ADD_FAILURE() << "loaded a checkpoint of another run (" << reason << ")";
    } catch (const moka::Error& e) {
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  };
  auto wider = config;
  wider.model = scale_width(config.base, 2);
  expect_load_fails(wider, "was saved with model.d_model = 32, but this run has 64");
  auto sp = config;
  sp.parameterization = Parameterization::sp;
  expect_load_fails(sp, "was saved with parameterization = mup, but this run has sp");
  auto half_base = config;  // the same model, tuned at half its width
  half_base.base.d_model /= 2;
  half_base.base.num_heads /= 2;
  half_base.base.num_experts /= 2;
  ASSERT_EQ(scale_width(half_base.base, 2).d_model, config.model.d_model);
  expect_load_fails(half_base, "base.d_model = 32, but this run has 16");

  auto edited = [&](auto edit) {
    auto f = read_safetensors(file);
    edit(f);
    write_safetensors(file, f);
  };
  const std::string tensor = Trainer(config, *text).rules().front().spec.name;
  edited([&](SafetensorsFile& f) { f.tensors.erase("adam_v/" + tensor); });
  expect_load_fails(config, "has no tensor 'adam_v/" + tensor + "'");
  Trainer(config, *text).save(file);
  edited([&](SafetensorsFile& f) { f.put(tensor, std::vector<float>(3), {3}); });
  expect_load_fails(config, "tensor '" + tensor + "' is f32 [3], this model's is f32 [");
  Trainer(config, *text).save(file);
  edited([&](SafetensorsFile& f) { f.metadata["step"] = "-3"; });
  expect_load_fails(config, "metadata step '-3' is not a step count");
  edited([&](SafetensorsFile& f) { f.metadata["format"] = "moka-train-checkpoint-1"; });
  expect_load_fails(config, "has checkpoint format moka-train-checkpoint-1");
  edited([&](SafetensorsFile& f) { f.metadata.erase("format"); });
  expect_load_fails(config, "is not a moka training checkpoint: its metadata has no format");
  fs::remove(file);
}

// Single-bit flips in every region of a training checkpoint fail the resume: each byte of the
// header length, 40 places over the header text and its padding, 20 over the data section.
TEST(CheckpointResume, RefusesACheckpointWithAFlippedBitAnywhere) {
  MOKA_REQUIRE_CORPUS(text);
  const auto file = (fs::temp_directory_path() / "moka_resume_bitflip.safetensors").string();
  const auto config = tiny_train_config(Parameterization::mup, 1e-2);
  Trainer(config, *text).save(file);
  const std::string bytes = read_bytes(file);
  const uint64_t header_start = sizeof(uint64_t), data = data_start(bytes);
  std::vector<std::string> copies = bit_flips(bytes, 0, header_start, header_start);
  for (auto&& region : {bit_flips(bytes, header_start, data, 40), data_bit_flips(bytes)})
    copies.insert(copies.end(), region.begin(), region.end());
  for (size_t i = 0; i < copies.size(); ++i) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << copies[i];
    Trainer trainer(config, *text);
    try {
      trainer.load(file);
      ADD_FAILURE() << "resumed from a checkpoint with a flipped bit (copy " << i << ")";
    } catch (const moka::Error& e) {
      EXPECT_EQ(e.code(), moka::ErrorCode::io) << e.what();
      EXPECT_NE(std::string(e.what()).find(file + " is not a valid safetensors file"), std::string::npos) << e.what();
    }
  }
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  Trainer(config, *text).load(file);  // the undamaged file still resumes
  fs::remove(file);
}
