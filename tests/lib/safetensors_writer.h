#pragma once
// Valid safetensors bytes (F32 tensors) for the weights tests: what torch's writers produce.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace attnserve::testing {

struct TensorEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

/// A safetensors file holding `entries` in order (8-byte header length, JSON header, data).
inline std::string SafetensorsBytes(const std::vector<TensorEntry>& entries) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& e : entries) {
    header[e.name] = {{"dtype", "F32"},
                      {"shape", e.shape},
                      {"data_offsets", {data.size(), data.size() + e.values.size() * 4}}};
    data.append(reinterpret_cast<const char*>(e.values.data()), e.values.size() * 4);
  }
  const std::string h = header.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((uint64_t{h.size()} >> (8 * i)) & 0xff);
  return out + h + data;
}

}  // namespace attnserve::testing
