#include "train/checkpoint.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "core/atomic_file.hpp"
#include "train/params.hpp"

namespace moka::train {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors stores little-endian data");

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(const std::string& s) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64})
    if (s == safetensors_dtype(t)) return t;
  return std::nullopt;
}

// elements(shape) x element_size, or nothing when that overflows 64 bits or a dimension is negative.
std::optional<uint64_t> byte_count(const std::vector<int64_t>& shape, size_t element_size) {
  uint64_t bytes = element_size;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(bytes, uint64_t(d), &bytes)) return std::nullopt;
  return bytes;
}

std::string shape_text(const std::vector<int64_t>& shape) { return nlohmann::json(shape).dump(); }

// CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and final xor ~0, the
// iSCSI/ext4 checksum; crc32c("123456789") = 0xE3069283), slicing-by-8 so that checksumming a
// multi-gigabyte checkpoint costs a fraction of writing it. Tables built at compile time.
constexpr auto kCrc32cTables = [] {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    t[0][i] = c;
  }
  for (size_t s = 1; s < 8; ++s)
    for (size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  return t;
}();

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  const auto& t = kCrc32cTables;
  uint32_t c = ~0u;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian, asserted above
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
        t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
  }
  for (; n > 0; ++p, --n) c = (c >> 8) ^ t[0][(c ^ *p) & 0xFF];
  return ~c;
}

namespace {

uint32_t text_crc32c(const std::string& s) { return crc32c(s.data(), s.size()); }

// The checksums travel in the one place safetensors leaves to the writer, __metadata__ (string
// values only, so other safetensors readers still load the file): under kChecksumsKey a JSON
// object mapping each tensor's name to the CRC-32C of its bytes, and under kHeaderChecksumKey
// the CRC-32C of the header without that entry: every tensor's name, dtype, shape and offsets,
// the metadata and the tensors' checksums (a flipped shape or step count would resume wrong).
// The reader also requires the header to be byte for byte the text the writer makes of what it
// holds, so a flip that leaves its meaning alone (a padding byte, an escape) is refused too: no
// bit of a file goes unchecked. kFormatKey names this layout; safetensors has no version field.
constexpr const char* kChecksumsKey = "moka.crc32c";
constexpr const char* kHeaderChecksumKey = "moka.header_crc32c";
constexpr const char* kFormatKey = "moka.checksum_format";
constexpr const char* kFormat = "2";              // format 1 (no kFormatKey) checksummed the metadata, not the header
constexpr const char* kReservedPrefix = "moka.";  // the writer's metadata keys

std::string crc_text(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof(text), "%08x", crc);
  return text;
}

// The header text as the writer writes it: compact JSON, keys sorted (nlohmann::json's std::map;
// an order-keeping ordered_json would copy a deeply nested value recursively as its vector of
// keys grows, overflowing the stack on a hostile header), padded with spaces to a multiple of 8
// bytes (the format's alignment).
std::string header_text(const nlohmann::json& header) {
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

Error corrupt(const std::string& path, const std::string& what) {
  return Error(ErrorCode::io, path + " is not a valid safetensors file: " + what);
}

struct TensorEntry {
  std::string name;
  StoredTensor tensor;
  uint64_t begin = 0, end = 0;  // within the data section
};

// `value` as a dimension or byte offset: a JSON integer in [0, 2^63). Not a fraction, a float
// such as 1e3, or a boolean: nlohmann's get<int64_t>() would truncate those silently (a shape
// [2.5, 3] read as [2, 3]) or, beyond int64's range, convert them with undefined behaviour.
std::optional<int64_t> non_negative_integer(const nlohmann::json& value) {
  if (value.is_number_unsigned() && value.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()))
    return int64_t(value.get<uint64_t>());
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return value.get<int64_t>();
  return std::nullopt;
}

TensorEntry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& entry,
                        uint64_t data_size) {
  const std::string what = "tensor '" + name + "'";
  const auto malformed = [&](const std::string& problem) {
    return corrupt(path, what + " needs dtype, shape and data_offsets (" + problem + ")");
  };
  // Fields by reference: copying a value nested 100k deep would recurse as deep.
  const auto field = [&](const char* key) -> const nlohmann::json& {
    if (!entry.is_object()) throw malformed(std::string("its entry is ") + entry.type_name() + ", not an object");
    if (!entry.contains(key)) throw malformed(std::string("it has no ") + key);
    return entry.at(key);
  };
  TensorEntry e{name, {}, 0, 0};
  const auto& dtype_field = field("dtype");
  if (!dtype_field.is_string()) throw malformed("its dtype must be a string");
  const auto& shape = field("shape");
  const std::string shape_rule = "its shape must be a list of non-negative integers";
  if (!shape.is_array()) throw malformed(shape_rule);
  for (const auto& dimension : shape) {
    const auto d = non_negative_integer(dimension);
    if (!d) throw malformed(shape_rule);
    e.tensor.shape.push_back(*d);
  }
  const auto& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_integer() || !offsets[1].is_number_integer())
    throw corrupt(path, what + ": data_offsets must be [begin, end], two integers");
  // Nothing else: the header check serializes the entry, which must not recurse deep.
  if (entry.size() != 3) throw corrupt(path, what + " has fields besides dtype, shape and data_offsets");
  const std::string dtype = dtype_field.get<std::string>();
  const auto parsed = parse_safetensors_dtype(dtype);
  if (!parsed) throw corrupt(path, what + " has dtype " + dtype + ", which moka does not read");
  e.tensor.dtype = *parsed;
  const auto begin = non_negative_integer(offsets[0]), end = non_negative_integer(offsets[1]);
  if (!begin || !end || *begin > *end || uint64_t(*end) > data_size)
    throw corrupt(path, what + " at bytes [" + offsets[0].dump() + ", " + offsets[1].dump() + ") lies outside the " +
                            std::to_string(data_size) + "-byte data section");
  e.begin = uint64_t(*begin);
  e.end = uint64_t(*end);
  const auto expected = byte_count(e.tensor.shape, dtype_size(e.tensor.dtype));
  if (expected != e.end - e.begin)
    throw corrupt(path, what + " holds " + std::to_string(e.end - e.begin) + " bytes, but " + dtype + " " +
                            shape_text(e.tensor.shape) + " needs " +
                            (expected ? std::to_string(*expected) : std::string("more than 2^64")));
  return e;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const nlohmann::json& metadata) {
  if (!metadata.is_object()) throw corrupt(path, "__metadata__ is not an object");
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : metadata.items()) {
    if (!value.is_string()) throw corrupt(path, "__metadata__ entry '" + key + "' is not a string");
    out[key] = value.get<std::string>();
  }
  return out;
}

// `hex` as the CRC-32C it spells: exactly eight lowercase hex digits, as crc_text writes them
// (from_chars alone would take "D6FACF06" for "d6facf06", a flipped bit read back unnoticed).
uint32_t parse_crc(const std::string& path, const std::string& what, const std::string& hex) {
  if (hex.size() != 8 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw corrupt(path, "checksum of " + what + " is not eight lowercase hex digits");
  uint32_t crc = 0;
  std::from_chars(hex.data(), hex.data() + hex.size(), crc, 16);
  return crc;
}

// Checks the checksum format and takes it and the header's checksum out of `metadata`.
uint32_t take_header_checksum(const std::string& path, std::map<std::string, std::string>& metadata) {
  if (!metadata.count(kChecksumsKey))
    throw corrupt(path, std::string("its metadata has no ") + kChecksumsKey +
                            " checksums (written before moka checksummed checkpoints, or not by moka)");
  const auto format = metadata.extract(kFormatKey);
  if (!format)
    throw corrupt(path, std::string("its checksums are in moka's checksum format 1, which left the header "
                                    "unchecked; this moka reads format ") +
                            kFormat + " only");
  if (format.mapped() != kFormat)
    throw corrupt(path, "its checksums are in moka's checksum format '" + format.mapped() +
                            "'; this moka reads format " + kFormat + " only");
  const auto crc = metadata.extract(kHeaderChecksumKey);
  if (!crc) throw corrupt(path, std::string("its metadata has no ") + kHeaderChecksumKey + " (the header's checksum)");
  return parse_crc(path, "the header", crc.mapped());
}

// Takes the tensors' checksums out of `metadata` (take_header_checksum found them there): one per
// tensor of `entries`, no more, no fewer.
std::map<std::string, uint32_t> take_tensor_checksums(const std::string& path,
                                                      std::map<std::string, std::string>& metadata,
                                                      const std::vector<TensorEntry>& entries) {
  const std::string text = metadata.extract(kChecksumsKey).mapped();
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
  }
  if (!json.is_object()) throw corrupt(path, std::string("its ") + kChecksumsKey + " checksums are not a JSON object");
  std::map<std::string, uint32_t> out;
  for (const auto& [name, value] : json.items())
    out[name] = parse_crc(path, "'" + name + "'", value.is_string() ? value.get<std::string>() : "");
  for (const auto& e : entries)
    if (!out.count(e.name)) throw corrupt(path, "tensor '" + e.name + "' has no checksum");
  if (out.size() != entries.size()) throw corrupt(path, "it has checksums of tensors it does not hold");
  return out;
}

// Refuses a header whose text is not the writer's text of what it holds, or whose content
// (everything but the header checksum's entry, which `header` loses) fails that checksum.
void verify_header(const std::string& path, const std::string& text, nlohmann::json& header, uint32_t recorded_crc) {
  if (header_text(header) != text)
    throw corrupt(path, "its header is not byte for byte as moka writes it (the file is damaged)");
  header["__metadata__"].erase(kHeaderChecksumKey);
  const uint32_t crc = text_crc32c(header.dump());
  if (crc != recorded_crc)
    throw corrupt(path,
                  "checksum mismatch in the header (tensor names, dtypes, shapes, offsets or metadata): it has "
                  "CRC-32C " +
                      crc_text(crc) + ", the file records " + crc_text(recorded_crc) + " (the file is damaged)");
}

}  // namespace

template <typename T>
std::vector<T> StoredTensor::as() const {
  require(dtype == dtype_of<T>(), ErrorCode::io,
          std::string("checkpoint tensor is ") + to_string(dtype) + ", expected " + to_string(dtype_of<T>()));
  require(byte_count(shape, sizeof(T)) == bytes.size(), ErrorCode::shape_mismatch,
          "checkpoint tensor of shape " + shape_text(shape) + " holds " + std::to_string(bytes.size()) + " bytes");
  std::vector<T> out(bytes.size() / sizeof(T));
  // An empty vector's data() may be null, which memcpy may not be given even for 0 bytes.
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}
template std::vector<float> StoredTensor::as<float>() const;
template std::vector<double> StoredTensor::as<double>() const;

template <typename T>
void SafetensorsFile::put(const std::string& name, const std::vector<T>& values, std::vector<int64_t> shape) {
  require(byte_count(shape, 1) == values.size(), ErrorCode::shape_mismatch,
          "tensor '" + name + "' has " + std::to_string(values.size()) + " values, not shape " + shape_text(shape));
  StoredTensor t{dtype_of<T>(), std::move(shape), std::vector<uint8_t>(values.size() * sizeof(T))};
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());  // data() may be null when empty
  tensors[name] = std::move(t);
}
template void SafetensorsFile::put<float>(const std::string&, const std::vector<float>&, std::vector<int64_t>);
template void SafetensorsFile::put<double>(const std::string&, const std::vector<double>&, std::vector<int64_t>);

const StoredTensor& SafetensorsFile::get(const std::string& name) const {
  const auto it = tensors.find(name);
  require(it != tensors.end(), ErrorCode::io, "checkpoint has no tensor '" + name + "'");
  return it->second;
}

void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  for (const auto& [key, value] : file.metadata)
    require(key.rfind(kReservedPrefix, 0) != 0, ErrorCode::invalid_argument,
            "metadata key " + key + ": keys starting with " + kReservedPrefix + " are reserved for the checksums of " +
                path);
  nlohmann::json header;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    header[name] = {{"dtype", safetensors_dtype(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  nlohmann::json checksums = nlohmann::json::object();
  for (const auto& [name, t] : file.tensors) checksums[name] = crc_text(crc32c(t.bytes.data(), t.bytes.size()));
  auto& metadata = header["__metadata__"] = file.metadata;
  metadata[kFormatKey] = kFormat;
  metadata[kChecksumsKey] = checksums.dump();
  metadata[kHeaderChecksumKey] = crc_text(text_crc32c(header.dump()));  // of all the rest
  const std::string text = header_text(header);
  const uint64_t length = text.size();
  core::AtomicFile out(path);
  out.write(&length, sizeof(length));
  out.write(text.data(), text.size());
  for (const auto& [name, t] : file.tensors) out.write(t.bytes.data(), t.bytes.size());
  out.commit();
}

SafetensorsFile read_safetensors(const std::string& path) {
  // A directory opens as a stream on Linux, with a size of 2^63 - 1 bytes.
  std::error_code ec;
  require(!std::filesystem::is_directory(path, ec), ErrorCode::io, path + " is a directory, not a safetensors file");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  require(bool(in), ErrorCode::io, "cannot open " + path + ": " + std::strerror(errno));
  const uint64_t file_size = uint64_t(in.tellg());
  in.seekg(0);
  uint64_t header_size = 0;
  if (file_size < sizeof(header_size) || !in.read(reinterpret_cast<char*>(&header_size), sizeof(header_size)))
    throw corrupt(path, "it has " + std::to_string(file_size) + " bytes, fewer than the 8-byte header length");
  if (header_size > file_size - sizeof(header_size))
    throw corrupt(path, "its header length " + std::to_string(header_size) + " runs past the end of the " +
                            std::to_string(file_size) + "-byte file");
  std::string text(header_size, '\0');
  require(bool(in.read(text.data(), std::streamsize(header_size))), ErrorCode::io, "reading " + path + " failed");
  const uint64_t data_start = sizeof(header_size) + header_size, data_size = file_size - data_start;

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw corrupt(path, std::string("its header is not JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw corrupt(path, "its header is not a JSON object");
  SafetensorsFile file;
  std::vector<TensorEntry> entries;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") file.metadata = parse_metadata(path, entry);
    else entries.push_back(parse_entry(path, name, entry, data_size));
  }
  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  for (size_t i = 1; i < entries.size(); ++i)
    if (entries[i].begin < entries[i - 1].end)
      throw corrupt(path, "tensors '" + entries[i - 1].name + "' and '" + entries[i].name + "' overlap");
  verify_header(path, text, header, take_header_checksum(path, file.metadata));
  const auto checksums = take_tensor_checksums(path, file.metadata, entries);
  for (auto& e : entries) {
    e.tensor.bytes.resize(e.end - e.begin);
    in.seekg(std::streamoff(data_start + e.begin));
    require(bool(in.read(reinterpret_cast<char*>(e.tensor.bytes.data()), std::streamsize(e.tensor.bytes.size()))),
            ErrorCode::io, "reading tensor '" + e.name + "' of " + path + " failed");
    const uint32_t crc = crc32c(e.tensor.bytes.data(), e.tensor.bytes.size());
    if (crc != checksums.at(e.name))
      throw corrupt(path, "checksum mismatch in tensor '" + e.name + "': its bytes have CRC-32C " + crc_text(crc) +
                              ", the file records " + crc_text(checksums.at(e.name)) + " (the file is damaged)");
    file.tensors[e.name] = std::move(e.tensor);
  }
  return file;
}

}  // namespace moka::train
