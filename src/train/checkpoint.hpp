// The safetensors file format: an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// then the tensors' bytes, offsets relative to the end of the header.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "moka/tensor.hpp"

namespace moka::train {

struct StoredTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  template <typename T>
  std::vector<T> as() const;  // checks the dtype and that the bytes hold exactly the shape
};

struct SafetensorsFile {
  std::map<std::string, StoredTensor> tensors;
  std::map<std::string, std::string> metadata;

  template <typename T>
  void put(const std::string& name, const std::vector<T>& values, std::vector<int64_t> shape);
  const StoredTensor& get(const std::string& name) const;  // throws io when absent
};

// Writes a temporary file next to `path`, flushes it to disk and renames it over `path`: a
// crash or kill at any moment leaves either the previous file or the new one, never a torn one.
// The temporaries of `path` that killed writers left are removed once the new file is in place.
void write_safetensors(const std::string& path, const SafetensorsFile& file);
// The writer records in __metadata__ a CRC-32C of every tensor's bytes and one of the whole
// header (names, dtypes, shapes, offsets, metadata), under keys starting with "moka." (which
// callers may not use); the reader verifies them, and that the header is byte for byte as the
// writer writes it, so a flipped bit anywhere in the file is refused. It removes those keys.
//
// Throws io, naming the file, on anything that is not a well-formed safetensors file: short
// reads, lengths or offsets past the end, byte counts that disagree with dtype x shape,
// overlapping tensors, malformed JSON; on missing checksums, an older checksum format (named)
// or a checksum mismatch, naming the tensor or the header. Allocates no more than the file's size.
SafetensorsFile read_safetensors(const std::string& path);

// CRC-32C (Castagnoli, as iSCSI and ext4 use it) of `size` bytes: the checkpoints' checksum.
uint32_t crc32c(const void* data, size_t size);

}  // namespace moka::train
