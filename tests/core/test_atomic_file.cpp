// Atomic output files (core/atomic_file.hpp), which checkpoints and every result file go
// through: the destination holds its old contents or the new ones, whole, never a torn file; a
// failed write leaves no temporary behind; killed writers' temporaries are removed by the next
// commit to the same path, and nothing else is.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/atomic_file.hpp"
#include "moka/error.hpp"
#include "reader_fuzz.hpp"

using moka::core::AtomicFile;
using moka::testing::read_bytes;
namespace fs = std::filesystem;

namespace {

class AtomicFileTest : public moka::testing::ScratchFolder {
 protected:
  // The names in the folder, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& entry : fs::directory_iterator(path("."))) out.push_back(entry.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

using Names = std::vector<std::string>;

// `write` throws a moka::Error whose message holds every one of `parts`.
template <class Write>
void expect_error(Write write, const std::vector<std::string>& parts) {
  try {
    write();
    ADD_FAILURE() << "no error; expected one containing " << parts.front();
  } catch (const moka::Error& e) {
    EXPECT_EQ(e.code(), moka::ErrorCode::io) << e.what();
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_F(AtomicFileTest, CommitReplacesTheFileAndLeavesNoTemporary) {
  const auto file = write("result.csv", "old\n");
  AtomicFile out(file);
  out.write("new ");
  out.write(std::string(100000, 'x'));
  // Until the commit the destination holds its old contents; the new ones are in a temporary.
  EXPECT_EQ(read_bytes(file), "old\n");
  ASSERT_EQ(names().size(), 2u);
  EXPECT_EQ(names()[1].rfind("result.csv.tmp." + std::to_string(::getpid()) + ".", 0), 0u) << names()[1];
  out.commit();
  EXPECT_EQ(read_bytes(file), "new " + std::string(100000, 'x'));
  EXPECT_EQ(names(), Names{"result.csv"});
}

TEST_F(AtomicFileTest, NoCommitKeepsTheOldFileOrNone) {
  const auto file = write("result.csv", "old\n");
  const auto fail_part_way = [](const std::string& destination) {
    AtomicFile out(destination);
    out.write("half of the new ");
    throw std::runtime_error("the run failed");
  };
  EXPECT_THROW(fail_part_way(file), std::runtime_error);
  EXPECT_EQ(read_bytes(file), "old\n");
  EXPECT_THROW(fail_part_way(path("absent.csv")), std::runtime_error);
  EXPECT_EQ(names(), Names{"result.csv"});
}

// A write that fails (here the file-size limit, as a full disk would) is an error naming the
// file; the destination keeps its old contents and the temporary is gone.
TEST_F(AtomicFileTest, FailedWriteKeepsTheOldFileAndRemovesTheTemporary) {
  const auto file = write("result.json", "old\n");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead of killing the process
    const rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      moka::core::write_file_atomically(file, std::string(1 << 20, 'x'));
    } catch (const moka::Error& e) {
      const std::string expected = "writing " + file + " failed: " + std::strerror(EFBIG);
      ::_exit(std::string(e.what()).find(expected) != std::string::npos ? 0 : 2);
    }
    ::_exit(1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the write did not fail; 2: the error did not name the file and cause";
  EXPECT_EQ(read_bytes(file), "old\n");
  EXPECT_EQ(names(), Names{"result.json"});
}

TEST_F(AtomicFileTest, ErrorsNameThePathAndLeaveNothingBehind) {
  const auto missing = path("no/such/dir/result.csv");
  expect_error([&] { moka::core::write_file_atomically(missing, "x"); },
               {"cannot create a temporary file next to " + missing, std::strerror(ENOENT)});
  // A directory in the destination's place: the rename fails, the temporary is removed.
  fs::create_directory(path("taken"));
  expect_error([&] { moka::core::write_file_atomically(path("taken"), "x"); },
               {"cannot rename " + path("taken.tmp."), " to " + path("taken")});
  EXPECT_EQ(names(), Names{"taken"});
}

TEST_F(AtomicFileTest, NewFileGetsTheModeOpenWouldGive) {
  const mode_t old_mask = ::umask(027);
  moka::core::write_file_atomically(path("result.csv"), "x");
  ::umask(old_mask);
  EXPECT_EQ(fs::status(path("result.csv")).permissions(),
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
}

TEST_F(AtomicFileTest, AppendKeepsTheOldLinesAndCreatesAMissingFile) {
  const auto file = path("routing.jsonl");
  moka::core::append_file_atomically(file, "{\"epoch\":0}\n");
  moka::core::append_file_atomically(file, "{\"epoch\":1}\n");
  EXPECT_EQ(read_bytes(file), "{\"epoch\":0}\n{\"epoch\":1}\n");
  EXPECT_EQ(names(), Names{"routing.jsonl"});
  // What cannot be read is never replaced by a file that lost it.
  fs::create_directory(path("taken"));
  expect_error([&] { moka::core::append_file_atomically(path("taken"), "x"); },
               {"reading " + path("taken") + " failed", std::strerror(EISDIR)});
  EXPECT_EQ(names(), (Names{"routing.jsonl", "taken"}));
}

// A commit removes the temporaries of its own path whose writer is gone, and nothing else: not
// another path's, not a live writer's, not a name that only resembles the pattern.
TEST_F(AtomicFileTest, CommitRemovesOnlyStaleTemporariesOfItsPath) {
  const pid_t gone = ::fork();
  ASSERT_GE(gone, 0);
  if (gone == 0) ::_exit(0);
  ::waitpid(gone, nullptr, 0);
  const std::string dead = std::to_string(gone), alive = std::to_string(::getpid());
  const std::string stale = "ckpt.safetensors.tmp." + dead + ".aB3xY9";
  const std::vector<std::string> kept = {
      "ckpt.safetensors.tmp." + alive + ".aB3xY9",  // a save in progress
      "other.safetensors.tmp." + dead + ".aB3xY9",  // another path's
      "xckpt.safetensors.tmp." + dead + ".aB3xY9",  // another path's
      "ckpt.safetensors.tmp." + dead + ".aB3xY",    // five random characters
      "ckpt.safetensors.tmp." + dead + ".aB3xY9z",  // seven
      "ckpt.safetensors.tmp." + dead + ".aB3-Y9",   // not from mkstemp's alphabet
      "ckpt.safetensors.tmp." + dead + "x.aB3xY9",  // not a pid
      "ckpt.safetensors.tmp.0" + dead + ".aB3xY9",  // not as the writer spells its pid
      "ckpt.safetensors.tmp..aB3xY9",               // no pid
      "ckpt.safetensors.tmp.aB3xY9",                // no pid
      "ckpt.safetensors.bak",
  };
  for (const auto& name : kept) write(name, "keep");
  write(stale, "stale");
  fs::create_directory(path("ckpt.safetensors.tmp." + dead + ".dIr123"));  // not a file
  moka::core::write_file_atomically(path("ckpt.safetensors"), "new");
  EXPECT_FALSE(fs::exists(path(stale)));
  for (const auto& name : kept) EXPECT_TRUE(fs::exists(path(name))) << name;
  EXPECT_TRUE(fs::is_directory(path("ckpt.safetensors.tmp." + dead + ".dIr123")));
  EXPECT_EQ(read_bytes(path("ckpt.safetensors")), "new");
}

}  // namespace
