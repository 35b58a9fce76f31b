// Output files that are whole or absent: written under a temporary name next to the destination
// and renamed over it, so a run that fails or is killed part-way never leaves a torn file and
// never loses the destination's previous contents.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace moka::core {

// An output file written under a temporary name in its destination's directory,
// <path>.tmp.<writer's pid>.<six random characters>; commit() puts the bytes on disk, renames the
// file over the destination and removes the temporaries of the same destination whose writer
// was killed. Without commit() (an error part-way) the temporary is removed and the destination
// keeps its old contents (or stays absent).
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(const void* data, size_t size);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void commit();

 private:
  std::string path_, temp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Replaces `path` with a file holding exactly `content`, atomically.
void write_file_atomically(const std::string& path, std::string_view content);

// Replaces `path` with its current contents (none when it does not exist) followed by `text`,
// atomically: a reader sees the file before or after the append, never a partial line. Two
// processes appending to one file at once are not merged: the later rename wins.
void append_file_atomically(const std::string& path, std::string_view text);

}  // namespace moka::core
