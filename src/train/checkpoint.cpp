#include "train/checkpoint.hpp"

#include <bit>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

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
  }
  return "?";
}

DType parse_safetensors_dtype(const std::string& s) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::i32})
    if (s == safetensors_dtype(t)) return t;
  throw Error(ErrorCode::io, "safetensors dtype " + s + " is not supported");
}

}  // namespace

template <typename T>
std::vector<T> StoredTensor::as() const {
  require(dtype == dtype_of<T>(), ErrorCode::io,
          std::string("checkpoint tensor is ") + to_string(dtype) + ", expected " + to_string(dtype_of<T>()));
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}
template std::vector<float> StoredTensor::as<float>() const;
template std::vector<double> StoredTensor::as<double>() const;

template <typename T>
void SafetensorsFile::put(const std::string& name, const std::vector<T>& values, std::vector<int64_t> shape) {
  StoredTensor t{dtype_of<T>(), std::move(shape), std::vector<uint8_t>(values.size() * sizeof(T))};
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
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
  nlohmann::ordered_json header;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    header[name] = {{"dtype", safetensors_dtype(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the format pads the header to 8 bytes
  const uint64_t length = text.size();
  std::ofstream out(path, std::ios::binary);
  require(bool(out), ErrorCode::io, "cannot write " + path);
  out.write(reinterpret_cast<const char*>(&length), sizeof(length));
  out.write(text.data(), std::streamsize(text.size()));
  for (const auto& [name, t] : file.tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
  require(bool(out), ErrorCode::io, "writing " + path + " failed");
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  require(bool(in), ErrorCode::io, "cannot open " + path);
  uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), sizeof(length));
  require(bool(in) && length < (uint64_t(1) << 30), ErrorCode::io, path + " is not a safetensors file");
  std::string text(length, '\0');
  in.read(text.data(), std::streamsize(length));
  const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto header = nlohmann::json::parse(text);
  SafetensorsFile file;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      file.metadata = entry.get<std::map<std::string, std::string>>();
      continue;
    }
    const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
    require(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data.size(), ErrorCode::io,
            path + ": tensor " + name + " lies outside the file");
    StoredTensor t{parse_safetensors_dtype(entry.at("dtype")), entry.at("shape").get<std::vector<int64_t>>(), {}};
    t.bytes.assign(data.begin() + std::ptrdiff_t(offsets[0]), data.begin() + std::ptrdiff_t(offsets[1]));
    file.tensors[name] = std::move(t);
  }
  return file;
}

}  // namespace moka::train
