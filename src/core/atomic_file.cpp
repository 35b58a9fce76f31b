#include "core/atomic_file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>

#include "moka/error.hpp"

namespace moka::core {
namespace {

std::string with_errno(const std::string& what, int err = errno) { return what + ": " + std::strerror(err); }

// The temporary names of `path`: path.tmp.<writer's pid>.<mkstemp's six characters>. The pid
// tells a killed writer's leftover from a write in progress.
std::string temporary_prefix(const std::string& path) { return path + ".tmp."; }

// The pid of the writer of `name` when it is a temporary name of the path whose file name is
// `file_name`, else nothing.
std::optional<pid_t> temporary_writer(const std::string& name, const std::string& file_name) {
  const std::string prefix = temporary_prefix(file_name);
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const char* const digits = name.data() + prefix.size();
  const char* const end = name.data() + name.size();
  pid_t pid = 0;
  const auto [after_pid, err] = std::from_chars(digits, end, pid);
  // As the writer spells it: a positive pid without leading zeros, a dot, six of [A-Za-z0-9].
  constexpr ptrdiff_t kRandom = 6;  // mkstemp's XXXXXX
  const bool as_written = err == std::errc() && pid > 0 && *digits != '0';
  if (!as_written || end - after_pid != 1 + kRandom || *after_pid != '.') return std::nullopt;
  const bool from_mkstemp =
      std::all_of(after_pid + 1, end, [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; });
  return from_mkstemp ? std::optional(pid) : std::nullopt;
}

// Removes the temporaries of `path` that writers killed part-way left behind: regular files of
// the exact temporary-name pattern whose writer process no longer exists. Best effort: a file
// that cannot be listed or removed stays, as it would have without this.
void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path destination(path);
  const fs::path dir = destination.parent_path().empty() ? fs::path(".") : destination.parent_path();
  const std::string file_name = destination.filename().string();
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto writer = temporary_writer(it->path().filename().string(), file_name);
    if (writer && it->symlink_status(ec).type() == fs::file_type::regular && ::kill(*writer, 0) != 0 && errno == ESRCH)
      fs::remove(it->path(), ec);
    ec.clear();
  }
}

// The bytes of `path`, or none when it does not exist. Read with read(2), whose errors are
// reported, where a stream would end early and silently drop the rest of the file.
std::string existing_contents(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return {};
  require(fd >= 0, ErrorCode::io, with_errno("cannot read " + path));
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(fd);
      require(err == 0, ErrorCode::io, with_errno("reading " + path + " failed", err));
      return text;
    }
    text.append(buffer, size_t(n));
  }
}

}  // namespace

AtomicFile::AtomicFile(std::string path)
    : path_(std::move(path)), temp_(temporary_prefix(path_) + std::to_string(::getpid()) + ".XXXXXX") {
  fd_ = ::mkstemp(temp_.data());
  require(fd_ >= 0, ErrorCode::io, with_errno("cannot create a temporary file next to " + path_));
  // mkstemp creates the file readable by its owner alone; give it the mode open() would.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd_, 0666 & ~mask);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    require(n > 0, ErrorCode::io, with_errno("writing " + path_ + " failed"));
    p += n;
    size -= size_t(n);
  }
}

void AtomicFile::commit() {
  require(::fsync(fd_) == 0, ErrorCode::io, with_errno("flushing " + path_ + " to disk failed"));
  require(::close(std::exchange(fd_, -1)) == 0, ErrorCode::io, with_errno("writing " + path_ + " failed"));
  require(::rename(temp_.c_str(), path_.c_str()) == 0, ErrorCode::io,
          with_errno("cannot rename " + temp_ + " to " + path_));
  committed_ = true;
  // The rename survives a power cut only once the directory itself is on disk. Some file
  // systems cannot sync a directory (EINVAL); the rename is still atomic there.
  const auto dir = std::filesystem::path(path_).parent_path();
  const int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  require(dir_fd >= 0, ErrorCode::io, with_errno("cannot open the directory of " + path_));
  const int err = ::fsync(dir_fd) == 0 ? 0 : errno;
  ::close(dir_fd);
  require(err == 0 || err == EINVAL, ErrorCode::io, with_errno("flushing the directory of " + path_ + " failed", err));
  remove_stale_temporaries(path_);
}

void write_file_atomically(const std::string& path, std::string_view content) {
  AtomicFile out(path);
  out.write(content);
  out.commit();
}

void append_file_atomically(const std::string& path, std::string_view text) {
  AtomicFile out(path);
  out.write(existing_contents(path));
  out.write(text);
  out.commit();
}

}  // namespace moka::core
