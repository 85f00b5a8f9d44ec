#include "server/weights/safetensors.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <set>
#include <tuple>

#include "attnserve/half.h"

namespace attnserve {

StatusOr<int64_t> NonNegativeJsonInt(const nlohmann::json& v, const std::string& field) {
  if (v.is_number_unsigned() && v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) {
    return v.get<int64_t>();
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return v.get<int64_t>();
  return Status(
      StatusCode::kFailedPrecondition,
      field + " is " + v.dump() + "; expected an integer from 0 to " + std::to_string(INT64_MAX));
}

namespace {

// What nlohmann's parser says is wrong with a text (where, and what it expected), without building
// anything: a SAX pass that keeps only the error.
class JsonErrorOnly : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::string error;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = e.what();
    return false;
  }
};

}  // namespace

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
  if (j.is_discarded()) {
    JsonErrorOnly
        why;  // e.g. "parse error at line 3, column 17: ... invalid literal; last read: 'N'"
    nlohmann::json::sax_parse(text, &why);
    // The parser quotes what it read: bytes that are not printable ASCII as \xNN, so that the
    // message (and the log) stays text whatever the file holds.
    std::string quoted;
    for (const char c : why.error) {
      const auto u = static_cast<unsigned char>(c);
      if (u >= 0x20 && u < 0x7f) {
        quoted += c;
      } else {
        static const char kHex[] = "0123456789abcdef";
        quoted += {'\\', 'x', kHex[u >> 4], kHex[u & 15]};
      }
    }
    why.error = quoted;
    const size_t at = why.error.find("] ");
    return Status(StatusCode::kFailedPrecondition,
                  where + ": not valid JSON" +
                      (why.error.empty()
                           ? ""
                           : " (" + why.error.substr(at == std::string::npos ? 0 : at + 2) + ")"));
  }
  return j;
}

namespace {

// One header entry, checked: dtype, shape and the data range it claims.
struct EntryPlan {
  std::string dtype;
  size_t elem = 0;  // Bytes per element.
  std::vector<int64_t> shape;
  uint64_t numel = 1, begin = 0, end = 0;
};

// The element size of a safetensors dtype this server reads; 0 for any other.
size_t ElementBytes(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "F16" || dtype == "BF16") return 2;
  if (dtype == "F64") return 8;
  return 0;
}

StatusOr<EntryPlan> PlanEntry(const std::string& name, const nlohmann::json& e, uint64_t data_len,
                              const std::function<Status(const std::string&)>& fail) {
  if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
      !e.contains("data_offsets") || !e["dtype"].is_string() || !e["shape"].is_array() ||
      !e["data_offsets"].is_array() || e["data_offsets"].size() != 2) {
    return fail("'" + name + "': header entry needs dtype, shape and data_offsets [begin, end]");
  }
  EntryPlan p;
  p.dtype = e["dtype"].get<std::string>();
  p.elem = ElementBytes(p.dtype);
  if (p.elem == 0) {
    return fail("'" + name + "': dtype " + p.dtype +
                " is not supported; expected F32, F16, BF16 or F64");
  }
  if (e["shape"].size() > 8) return fail("'" + name + "': shape has more than 8 dimensions");
  for (const auto& d : e["shape"]) {
    if (!d.is_number_unsigned())
      return fail("'" + name + "': shape must hold non-negative integers");
    const uint64_t dim = d.get<uint64_t>();
    p.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(dim, INT64_MAX)));
    if (__builtin_mul_overflow(p.numel, dim, &p.numel) || p.numel > (uint64_t{1} << 34))
      return fail("'" + name + "': shape " + e["shape"].dump() + " has more than 2^34 elements");
  }
  const auto& off = e["data_offsets"];
  if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    return fail("'" + name + "': data_offsets must be non-negative integers");
  p.begin = off[0].get<uint64_t>();
  p.end = off[1].get<uint64_t>();
  if (p.begin > p.end || p.end > data_len) {
    return fail("'" + name + "': data_offsets [" + std::to_string(p.begin) + ", " +
                std::to_string(p.end) + "] lie outside the " + std::to_string(data_len) +
                "-byte data section");
  }
  if (p.end - p.begin != p.numel * p.elem) {
    return fail("'" + name + "': data_offsets span " + std::to_string(p.end - p.begin) +
                " bytes, but shape " + ShapeString(p.shape) + " of " + p.dtype + " needs " +
                std::to_string(p.numel * p.elem));
  }
  return p;
}

// The entry's elements as float32, from its bytes at `src`.
HostTensor Read(const EntryPlan& p, const char* src) {
  HostTensor t;
  t.shape = p.shape;
  t.values.resize(p.numel);
  for (uint64_t i = 0; i < p.numel; ++i) {
    if (p.elem == 4) {
      std::memcpy(&t.values[i], src + 4 * i, 4);
    } else if (p.elem == 8) {
      double d;
      std::memcpy(&d, src + 8 * i, 8);
      t.values[i] = static_cast<float>(d);
    } else {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      t.values[i] = p.dtype == "BF16" ? BFloat16ToFloat(h) : HalfToFloat(h);
    }
  }
  return t;
}

// The tensors must tile the data section: an overlap would make two tensors share bytes, a hole
// would carry bytes nobody asked for.
Status CheckTiling(std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges,
                   uint64_t data_len, const std::function<Status(const std::string&)>& fail) {
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
  return Status::Ok();
}

}  // namespace

StatusOr<NamedTensors> ParseSafetensors(const std::string& bytes, const std::string& where) {
  const std::function<Status(const std::string&)> fail = [&](const std::string& what) {
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
    ASSIGN_OR_RETURN(const EntryPlan p, PlanEntry(it.key(), it.value(), data_len, fail));
    ranges.emplace_back(p.begin, p.end, it.key());
    out.emplace(it.key(), Read(p, data + p.begin));
  }
  if (out.empty()) return fail("holds no tensors");
  RETURN_IF_ERROR(CheckTiling(std::move(ranges), data_len, fail));
  return out;
}

StatusOr<NamedTensors> ReadSafetensorsTensors(
    const std::string& path, const std::function<bool(const std::string&)>& select) {
  const std::function<Status(const std::string&)> fail = [&](const std::string& what) {
    return Status(StatusCode::kFailedPrecondition, path + ": " + what);
  };
  ASSIGN_OR_RETURN(FileRanges file, FileRanges::Open(path));
  if (file.size() < 8)
    return fail("truncated: " + std::to_string(file.size()) + " bytes, no header");
  ASSIGN_OR_RETURN(const std::string len_bytes, file.Read(0, 8));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(len_bytes[i]);
  if (header_len > file.size() - 8) {
    return fail("header length " + std::to_string(header_len) + " runs past the end of the " +
                std::to_string(file.size()) + "-byte file (truncated?)");
  }
  if (header_len > (uint64_t{100} << 20))
    return fail("header of " + std::to_string(header_len) + " bytes is over the format's 100 MB");
  ASSIGN_OR_RETURN(const std::string header_text, file.Read(8, header_len));
  ASSIGN_OR_RETURN(nlohmann::json header, ParseStrictJson(header_text, path + ": header"));
  if (!header.is_object()) return fail("header is not a JSON object");
  const uint64_t data_start = 8 + header_len, data_len = file.size() - data_start;
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  std::vector<std::pair<std::string, EntryPlan>> wanted;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    ASSIGN_OR_RETURN(EntryPlan p, PlanEntry(it.key(), it.value(), data_len, fail));
    ranges.emplace_back(p.begin, p.end, it.key());
    if (select(it.key())) wanted.emplace_back(it.key(), std::move(p));
  }
  if (ranges.empty()) return fail("holds no tensors");
  RETURN_IF_ERROR(CheckTiling(std::move(ranges), data_len, fail));
  NamedTensors out;
  for (const auto& [name, p] : wanted) {
    ASSIGN_OR_RETURN(const std::string bytes, file.Read(data_start + p.begin, p.end - p.begin));
    out.emplace(name, Read(p, bytes.data()));
  }
  return out;
}

}  // namespace attnserve
