#include "server/weights/safetensors.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <tuple>

#include "attnserve/half.h"

namespace attnserve {

StatusOr<nlohmann::json> ParseStrictJson(const std::string& text, const std::string& where) {
  std::vector<std::set<std::string>> keys;  // One set per open object.
  std::string problem;
  const auto check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (depth > 64) {
      if (problem.empty()) problem = "nested deeper than 64 levels";
      return false;
    }
    if (event == E::object_start) keys.emplace_back();
    if (event == E::object_end && !keys.empty()) keys.pop_back();
    if (event == E::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
        problem.empty()) {
      problem = "key '" + parsed.get<std::string>() + "' appears twice in one object";
    }
    return true;
  };
  nlohmann::json j = nlohmann::json::parse(text, check, /*allow_exceptions=*/false);
  if (!problem.empty()) return Status(StatusCode::kFailedPrecondition, where + ": " + problem);
  if (j.is_discarded()) return Status(StatusCode::kFailedPrecondition, where + ": not valid JSON");
  return j;
}

StatusOr<NamedTensors> ParseSafetensors(const std::string& bytes, const std::string& where) {
  auto fail = [&](const std::string& what) {
    return Status(StatusCode::kFailedPrecondition, where + ": " + what);
  };
  if (bytes.size() < 8)
    return fail("truncated: " + std::to_string(bytes.size()) + " bytes, no header");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > bytes.size() - 8) {
    return fail("header length " + std::to_string(header_len) + " runs past the end of the " +
                std::to_string(bytes.size()) + "-byte file (truncated?)");
  }
  if (header_len > (uint64_t{100} << 20))
    return fail("header of " + std::to_string(header_len) + " bytes is over the format's 100 MB");
  ASSIGN_OR_RETURN(nlohmann::json header,
                   ParseStrictJson(bytes.substr(8, header_len), where + ": header"));
  if (!header.is_object()) return fail("header is not a JSON object");
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  const char* data = bytes.data() + 8 + header_len;
  const uint64_t data_len = bytes.size() - 8 - header_len;
  NamedTensors out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string name = it.key();
    const nlohmann::json& e = it.value();
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets") || !e["dtype"].is_string() || !e["shape"].is_array() ||
        !e["data_offsets"].is_array() || e["data_offsets"].size() != 2) {
      return fail("'" + name + "': header entry needs dtype, shape and data_offsets [begin, end]");
    }
    const std::string dtype = e["dtype"].get<std::string>();
    size_t elem = 0;
    if (dtype == "F32")
      elem = 4;
    else if (dtype == "F16" || dtype == "BF16")
      elem = 2;
    else if (dtype == "F64")
      elem = 8;
    else
      return fail("'" + name + "': dtype " + dtype +
                  " is not supported; expected F32, F16, BF16 or F64");
    HostTensor t;
    uint64_t numel = 1;
    if (e["shape"].size() > 8) return fail("'" + name + "': shape has more than 8 dimensions");
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned())
        return fail("'" + name + "': shape must hold non-negative integers");
      const uint64_t dim = d.get<uint64_t>();
      t.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(dim, INT64_MAX)));
      if (__builtin_mul_overflow(numel, dim, &numel) || numel > (uint64_t{1} << 34)) {
        return fail("'" + name + "': shape " + e["shape"].dump() + " has more than 2^34 elements");
      }
    }
    const auto& off = e["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return fail("'" + name + "': data_offsets must be non-negative integers");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_len) {
      return fail("'" + name + "': data_offsets [" + std::to_string(begin) + ", " +
                  std::to_string(end) + "] lie outside the " + std::to_string(data_len) +
                  "-byte data section");
    }
    if (end - begin != numel * elem) {
      return fail("'" + name + "': data_offsets span " + std::to_string(end - begin) +
                  " bytes, but shape " + ShapeString(t.shape) + " of " + dtype + " needs " +
                  std::to_string(numel * elem));
    }
    ranges.emplace_back(begin, end, name);
    t.values.resize(numel);
    const char* src = data + begin;
    for (uint64_t i = 0; i < numel; ++i) {
      if (elem == 4) {
        std::memcpy(&t.values[i], src + 4 * i, 4);
      } else if (elem == 8) {
        double d;
        std::memcpy(&d, src + 8 * i, 8);
        t.values[i] = static_cast<float>(d);
      } else {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        t.values[i] = dtype == "BF16" ? BFloat16ToFloat(h) : HalfToFloat(h);
      }
    }
    out.emplace(name, std::move(t));
  }
  if (out.empty()) return fail("holds no tensors");
  // The tensors must tile the data section: an overlap would make two tensors share bytes, a hole
  // would carry bytes nobody asked for.
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  std::string previous;
  for (const auto& [begin, end, name] : ranges) {
    if (begin < covered)
      return fail("'" + name + "' overlaps '" + previous + "' in the data section");
    if (begin > covered) {
      return fail("bytes [" + std::to_string(covered) + ", " + std::to_string(begin) +
                  ") of the data section belong to no tensor");
    }
    covered = end;
    previous = name;
  }
  if (covered != data_len) {
    return fail(std::to_string(data_len - covered) +
                " bytes after the last tensor belong to no tensor");
  }
  return out;
}

}  // namespace attnserve
