#include "server/http/oip_json.h"

#include <simdjson.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "attnserve/half.h"
#include "server/core/checked_math.h"
#include "server/http/float_text.h"

namespace attnserve {
namespace {

namespace dom = simdjson::dom;
using inference::InferParameter;
using inference::ModelInferRequest;

std::string Str(std::string_view s) { return std::string(s); }

const char* KindOf(dom::element_type t) {
  switch (t) {
    case dom::element_type::ARRAY:
      return "an array";
    case dom::element_type::OBJECT:
      return "an object";
    case dom::element_type::INT64:
    case dom::element_type::UINT64:
      return "an integer";
    case dom::element_type::DOUBLE:
      return "a number";
    case dom::element_type::STRING:
      return "a string";
    case dom::element_type::BOOL:
      return "a boolean";
    case dom::element_type::NULL_VALUE:
      return "null";
  }
  return "a value";
}

Status Wrong(const std::string& field, dom::element e, const std::string& expected) {
  return InvalidArgument(field + ": " + KindOf(e.type()) + "; expected " + expected);
}

StatusOr<std::string_view> StringOf(const std::string& field, dom::element e) {
  std::string_view s;
  if (e.get_string().get(s) != simdjson::SUCCESS) return Wrong(field, e, "a string");
  return s;
}

// A JSON parameter as the protocol's InferParameter of the same kind.
Status ParameterOf(const std::string& field, dom::element e, InferParameter* p) {
  switch (e.type()) {
    case dom::element_type::BOOL:
      p->set_bool_param(bool(e));
      return Status::Ok();
    case dom::element_type::INT64:
      p->set_int64_param(int64_t(e));
      return Status::Ok();
    case dom::element_type::UINT64:
      p->set_uint64_param(uint64_t(e));
      return Status::Ok();
    case dom::element_type::DOUBLE:
      p->set_double_param(double(e));
      return Status::Ok();
    case dom::element_type::STRING:
      p->set_string_param(Str(std::string_view(e)));
      return Status::Ok();
    default:
      return Wrong(field, e, "a boolean, a number or a string");
  }
}

// `parameters`: an object of parameters into `out`, except the names in `http_only`, whose values
// go to `taken` (the binary extension's, which the protocol's message does not carry).
Status ParametersOf(const std::string& field, dom::element e,
                    google::protobuf::Map<std::string, InferParameter>* out,
                    const std::vector<std::string>& http_only,
                    std::map<std::string, dom::element>* taken) {
  dom::object o;
  if (e.get_object().get(o) != simdjson::SUCCESS) return Wrong(field, e, "an object");
  for (dom::key_value_pair kv : o) {
    const std::string name = Str(kv.key);
    const std::string at = field + "['" + name + "']";
    if (std::find(http_only.begin(), http_only.end(), name) != http_only.end()) {
      (*taken)[name] = kv.value;
      continue;
    }
    if (out->count(name)) return InvalidArgument(at + ": given twice");
    RETURN_IF_ERROR(ParameterOf(at, kv.value, &(*out)[name]));
  }
  return Status::Ok();
}

StatusOr<std::vector<int64_t>> ShapeOf(const std::string& field, dom::element e) {
  dom::array a;
  if (e.get_array().get(a) != simdjson::SUCCESS) return Wrong(field, e, "an array of integers");
  std::vector<int64_t> shape;
  size_t i = 0;
  for (dom::element d : a) {
    int64_t v = 0;
    if (d.get_int64().get(v) != simdjson::SUCCESS || v < 0) {
      return InvalidArgument(field + "[" + std::to_string(i) + "]: " +
                             (d.is_int64() ? std::to_string(int64_t(d)) : KindOf(d.type())) +
                             "; expected an integer, 0 or more");
    }
    shape.push_back(v);
    ++i;
  }
  return shape;
}

// A datatype's JSON form: how many bytes each value takes and how it is read.
enum class JsonKind { kFloat32, kFloat16, kBFloat16, kBool, kInt64, kNone };

JsonKind KindOfDatatype(const std::string& datatype) {
  if (datatype == "FP32") return JsonKind::kFloat32;
  if (datatype == "FP16") return JsonKind::kFloat16;
  if (datatype == "BF16") return JsonKind::kBFloat16;
  if (datatype == "BOOL") return JsonKind::kBool;
  if (datatype == "INT64") return JsonKind::kInt64;
  return JsonKind::kNone;
}

size_t ElementBytes(JsonKind kind) {
  switch (kind) {
    case JsonKind::kFloat32:
      return 4;
    case JsonKind::kFloat16:
    case JsonKind::kBFloat16:
      return 2;
    case JsonKind::kBool:
      return 1;
    case JsonKind::kInt64:
      return 8;
    case JsonKind::kNone:
      return 0;
  }
  return 0;
}

// The leaves of a nested data array (arrays within arrays, any nesting the parser's depth bound
// allows), counted.
size_t CountLeaves(dom::element e) {
  if (!e.is_array()) return 1;
  size_t n = 0;
  for (dom::element c : dom::array(e)) n += c.is_array() ? CountLeaves(c) : 1;
  return n;
}

// One leaf written at `*at` as `kind`'s bytes (`*k`: its index, then counted). One not of the
// kind's JSON type fails, naming its index.
Status PutLeaf(const std::string& field, const std::string& datatype, JsonKind kind, dom::element e,
               char** at, size_t* k) {
  const auto wrong = [&](const char* expected) {
    return InvalidArgument(field + "[" + std::to_string(*k) + "]: " + KindOf(e.type()) +
                           "; expected " + expected + " for " + datatype);
  };
  switch (kind) {
    case JsonKind::kBool: {
      bool b = false;
      if (e.get_bool().get(b) != simdjson::SUCCESS) return wrong("true or false");
      **at = b ? 1 : 0;
      break;
    }
    case JsonKind::kInt64: {
      int64_t v = 0;
      if (e.get_int64().get(v) != simdjson::SUCCESS) return wrong("an integer");
      std::memcpy(*at, &v, 8);
      break;
    }
    default: {
      double d = 0;  // simdjson gives integers as doubles too.
      if (e.get_double().get(d) != simdjson::SUCCESS) return wrong("a number");
      const float f = static_cast<float>(d);
      const auto past = [&]() {
        return InvalidArgument(field + "[" + std::to_string(*k) + "]: " + std::to_string(d) +
                               " is past " + datatype + "'s range");
      };
      if (kind == JsonKind::kFloat32) {
        if (std::isinf(f)) return past();
        std::memcpy(*at, &f, 4);
      } else {
        const uint16_t h = kind == JsonKind::kFloat16 ? FloatToHalf(f) : FloatToBFloat16(f);
        if (std::isinf(kind == JsonKind::kFloat16 ? HalfToFloat(h) : BFloat16ToFloat(h)))
          return past();
        std::memcpy(*at, &h, 2);
      }
    }
  }
  *at += ElementBytes(kind);
  ++*k;
  return Status::Ok();
}

// The leaves written in row-major order at `*at` as `kind`'s bytes; `*k` counts them. The first
// that is not of the kind's JSON type fails, naming its index; one past `limit` ends the walk with
// `*k` at limit + 1 (the caller counts them all for its message). A float32 number is written here
// (the common case: a flat array of them, no call per number); anything else through PutLeaf.
Status PutLeaves(const std::string& field, const std::string& datatype, JsonKind kind,
                 dom::element e, size_t limit, char** at, size_t* k) {
  if (!e.is_array()) {
    if (*k < limit) return PutLeaf(field, datatype, kind, e, at, k);
    *k = limit + 1;
    return Status::Ok();
  }
  for (dom::element c : dom::array(e)) {
    double d = 0;
    float f = 0;
    if (kind == JsonKind::kFloat32 && c.get_double().get(d) == simdjson::SUCCESS &&
        !std::isinf(f = static_cast<float>(d))) {
      if (*k >= limit) {
        *k = limit + 1;
        return Status::Ok();
      }
      std::memcpy(*at, &f, 4);
      *at += 4;
      ++*k;
    } else {
      RETURN_IF_ERROR(PutLeaves(field, datatype, kind, c, limit, at, k));
      if (*k > limit) return Status::Ok();
    }
  }
  return Status::Ok();
}

// `data` as the raw bytes of a tensor of `datatype` and `shape`, in one walk: the room for the
// shape's values is taken first (never more than a body of `body_bytes` could hold: each value
// takes a character and a separator) and the values are counted as they are written.
Status DataBytes(const std::string& field, dom::element data, const std::string& datatype,
                 const std::vector<int64_t>& shape, size_t body_bytes, std::string* bytes) {
  const JsonKind kind = KindOfDatatype(datatype);
  if (kind == JsonKind::kNone) {
    return InvalidArgument(field + ": datatype '" + datatype +
                           "' has no JSON form here; allowed: FP32, FP16, BF16, BOOL, INT64");
  }
  std::optional<int64_t> count = int64_t{1};
  for (int64_t d : shape) count = count ? CheckedMul({*count, d}) : std::nullopt;
  const auto mismatch = [&] {
    return InvalidArgument(field + ": " + std::to_string(CountLeaves(data)) + " values for shape " +
                           ShapeString(shape) + "; expected " +
                           (count ? std::to_string(*count) : std::string("their product")));
  };
  if (!count || static_cast<uint64_t>(*count) > body_bytes / 2 + 1) return mismatch();
  const size_t expected = static_cast<size_t>(*count);
  bytes->resize(expected * ElementBytes(kind));
  char* at = bytes->data();
  size_t k = 0;
  RETURN_IF_ERROR(PutLeaves(field, datatype, kind, data, expected, &at, &k));
  return k == expected ? Status::Ok() : mismatch();
}

// The binary section's next `size` bytes for input `field`.
Status TakeBinary(const std::string& field, const std::string& body, size_t* next,
                  dom::element size_value, std::string* out) {
  uint64_t size = 0;
  if (size_value.get_uint64().get(size) != simdjson::SUCCESS)
    return Wrong(field + ".parameters['binary_data_size']", size_value, "an integer, 0 or more");
  if (size > body.size() - *next) {
    return InvalidArgument(field + ".parameters['binary_data_size']: " + std::to_string(size) +
                           " bytes, but only " + std::to_string(body.size() - *next) +
                           " remain after the JSON and the inputs before it");
  }
  out->assign(body.data() + *next, size);
  *next += size;
  return Status::Ok();
}

// One input object into `out`: its fields, and its bytes (JSON data, the binary section, or none
// when in a shared-memory region).
Status InputOf(const std::string& field, dom::element e, const std::string& body,
               std::optional<size_t> header_length, size_t* next_binary, ModelInferRequest* out) {
  dom::object o;
  if (e.get_object().get(o) != simdjson::SUCCESS) return Wrong(field, e, "an object");
  auto* t = out->add_inputs();
  std::optional<dom::element> data;
  std::map<std::string, dom::element> http;
  std::set<std::string> seen;
  for (dom::key_value_pair kv : o) {
    const std::string key = Str(kv.key), at = field + "." + key;
    if (!seen.insert(key).second) return InvalidArgument(at + ": given twice");
    if (key == "name") {
      ASSIGN_OR_RETURN(std::string_view s, StringOf(at, kv.value));
      t->set_name(Str(s));
    } else if (key == "datatype") {
      ASSIGN_OR_RETURN(std::string_view s, StringOf(at, kv.value));
      t->set_datatype(Str(s));
    } else if (key == "shape") {
      ASSIGN_OR_RETURN(std::vector<int64_t> shape, ShapeOf(at, kv.value));
      for (int64_t d : shape) t->add_shape(d);
    } else if (key == "parameters") {
      RETURN_IF_ERROR(
          ParametersOf(at, kv.value, t->mutable_parameters(), {"binary_data_size"}, &http));
    } else if (key == "data") {
      data = kv.value;
    } else {
      return InvalidArgument(field + ": '" + key +
                             "' is not a field of an input; allowed: name, datatype, shape, "
                             "parameters, data");
    }
  }
  const bool shared = t->parameters().count("shared_memory_region") > 0;
  auto binary = http.find("binary_data_size");
  if (binary != http.end()) {
    // The codec takes binary_data_size as the protocol's clients send it; keep it as an int64.
    (*t->mutable_parameters())["binary_data_size"].set_int64_param(
        binary->second.is_int64() ? int64_t(binary->second) : -1);
  }
  if (shared) {
    if (data || binary != http.end()) {
      return InvalidArgument(field +
                             ": in a shared-memory region, so no data and no "
                             "binary_data_size; send one or the other");
    }
    return Status::Ok();
  }
  std::string* bytes = out->add_raw_input_contents();
  if (binary != http.end()) {
    if (data) return InvalidArgument(field + ": data and binary_data_size; send one or the other");
    if (!header_length) {
      return InvalidArgument(field +
                             ".parameters['binary_data_size']: the request has no "
                             "Inference-Header-Content-Length header, so no binary data");
    }
    return TakeBinary(field, body, next_binary, binary->second, bytes);
  }
  if (!data) {
    return InvalidArgument(field +
                           ": no data; send data, parameters.binary_data_size or a "
                           "shared-memory region");
  }
  const std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
  return DataBytes(field + ".data", *data, t->datatype(), shape, body.size(), bytes);
}

Status OutputsOf(dom::element e, ModelInferRequest* out, HttpAnswerForm* form) {
  dom::array a;
  if (e.get_array().get(a) != simdjson::SUCCESS) return Wrong("outputs", e, "an array");
  size_t i = 0;
  for (dom::element item : a) {
    const std::string field = "outputs[" + std::to_string(i++) + "]";
    dom::object o;
    if (item.get_object().get(o) != simdjson::SUCCESS) return Wrong(field, item, "an object");
    auto* t = out->add_outputs();
    std::map<std::string, dom::element> http;
    std::set<std::string> seen;
    for (dom::key_value_pair kv : o) {
      const std::string key = Str(kv.key);
      if (!seen.insert(key).second) return InvalidArgument(field + "." + key + ": given twice");
      if (key == "name") {
        ASSIGN_OR_RETURN(std::string_view s, StringOf(field + ".name", kv.value));
        t->set_name(Str(s));
      } else if (key == "parameters") {
        RETURN_IF_ERROR(ParametersOf(field + ".parameters", kv.value, t->mutable_parameters(),
                                     {"binary_data", "classification"}, &http));
      } else {
        return InvalidArgument(field + ": '" + key +
                               "' is not a field of an output; allowed: name, parameters");
      }
    }
    if (http.count("classification")) {
      return InvalidArgument(field +
                             ".parameters['classification']: attnserve's outputs are not "
                             "classes; send none");
    }
    if (auto b = http.find("binary_data"); b != http.end()) {
      bool v = false;
      if (b->second.get_bool().get(v) != simdjson::SUCCESS)
        return Wrong(field + ".parameters['binary_data']", b->second, "true or false");
      form->binary[t->name()] = v;
    }
  }
  return Status::Ok();
}

Status RequestOf(dom::element root, const std::string& body, std::optional<size_t> header_length,
                 ModelInferRequest* out, HttpAnswerForm* form) {
  dom::object o;
  if (root.get_object().get(o) != simdjson::SUCCESS) return Wrong("the body", root, "an object");
  size_t next_binary = header_length.value_or(body.size());
  std::optional<dom::element> inputs;
  std::set<std::string> seen;
  for (dom::key_value_pair kv : o) {
    const std::string key = Str(kv.key);
    if (!seen.insert(key).second) return InvalidArgument(key + ": given twice");
    if (key == "id") {
      ASSIGN_OR_RETURN(std::string_view s, StringOf("id", kv.value));
      out->set_id(Str(s));
    } else if (key == "parameters") {
      std::map<std::string, dom::element> http;
      RETURN_IF_ERROR(ParametersOf("parameters", kv.value, out->mutable_parameters(),
                                   {"binary_data_output"}, &http));
      if (auto b = http.find("binary_data_output"); b != http.end()) {
        if (b->second.get_bool().get(form->binary_default) != simdjson::SUCCESS)
          return Wrong("parameters['binary_data_output']", b->second, "true or false");
      }
    } else if (key == "model_name" || key == "model_version") {
      // KServe's REST client names the model in the body too: it must be the path's.
      ASSIGN_OR_RETURN(std::string_view named, StringOf(key, kv.value));
      const std::string& path = key == "model_name" ? out->model_name() : out->model_version();
      if (named != path && !(key == "model_version" && path.empty())) {
        return InvalidArgument(key + ": '" + Str(named) + "', but the path names '" + path +
                               "'; send the same or none");
      }
      if (key == "model_version") out->set_model_version(Str(named));
    } else if (key == "inputs") {
      inputs = kv.value;
    } else if (key == "outputs") {
      RETURN_IF_ERROR(OutputsOf(kv.value, out, form));
    } else {
      return InvalidArgument("'" + key +
                             "' is not a field of an infer request; allowed: id, parameters, "
                             "inputs, outputs, model_name, model_version");
    }
  }
  if (!inputs) return InvalidArgument("inputs: missing; an infer request names its inputs");
  dom::array a;
  if (inputs->get_array().get(a) != simdjson::SUCCESS) return Wrong("inputs", *inputs, "an array");
  size_t i = 0;
  for (dom::element input : a) {
    RETURN_IF_ERROR(InputOf("inputs[" + std::to_string(i++) + "]", input, body, header_length,
                            &next_binary, out));
  }
  if (header_length && next_binary != body.size()) {
    return InvalidArgument("the body: " + std::to_string(body.size() - next_binary) +
                           " bytes after the inputs' binary data; expected none (the inputs' "
                           "binary_data_size add up to " +
                           std::to_string(next_binary - *header_length) + ")");
  }
  return Status::Ok();
}

// `json` (the first `size` bytes of `body`) parsed within `limits` into `root`.
Status ParseJson(dom::parser* parser, const std::string& body, size_t size,
                 const JsonLimits& limits, dom::element* root) {
  if (parser->allocate(std::max<size_t>(size, 1), limits.max_depth) != simdjson::SUCCESS)
    return Status(StatusCode::kResourceExhausted, "the body: no memory to parse its JSON");
  const bool padded = body.capacity() >= size + simdjson::SIMDJSON_PADDING;
  const simdjson::error_code error =
      parser->parse(reinterpret_cast<const uint8_t*>(body.data()), size, !padded).get(*root);
  if (error == simdjson::DEPTH_ERROR) {
    return InvalidArgument("the body: JSON nested deeper than " + std::to_string(limits.max_depth) +
                           " arrays and objects");
  }
  if (error != simdjson::SUCCESS) {
    return InvalidArgument(std::string("the body: not JSON (") + simdjson::error_message(error) +
                           ")");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<RegionRegistration> HttpRegistrationOf(std::string* body, const JsonLimits& limits) {
  dom::parser parser;
  dom::element root;
  RETURN_IF_ERROR(ParseJson(&parser, *body, body->size(), limits, &root));
  dom::object o;
  if (root.get_object().get(o) != simdjson::SUCCESS) return Wrong("the body", root, "an object");
  RegionRegistration r;
  bool has_key = false, has_size = false;
  for (dom::key_value_pair kv : o) {
    const std::string key = Str(kv.key);
    if (key == "key") {
      ASSIGN_OR_RETURN(std::string_view s, StringOf("key", kv.value));
      r.key = Str(s);
      has_key = true;
    } else if (key == "offset" || key == "byte_size") {
      uint64_t v = 0;
      if (kv.value.get_uint64().get(v) != simdjson::SUCCESS)
        return Wrong(key, kv.value, "an integer, 0 or more");
      (key == "offset" ? r.offset : r.byte_size) = v;
      has_size = has_size || key == "byte_size";
    } else {
      return InvalidArgument("'" + key +
                             "' is not a field of a registration; allowed: key, offset, "
                             "byte_size");
    }
  }
  if (!has_key || !has_size)
    return InvalidArgument(std::string(has_key ? "byte_size" : "key") + ": missing");
  return r;
}

Status HttpInferToOip(std::string* body, std::optional<size_t> header_length,
                      const std::string& model, const std::string& version,
                      const JsonLimits& limits, ModelInferRequest* out, HttpAnswerForm* form) {
  if (header_length && *header_length > body->size()) {
    return InvalidArgument("Inference-Header-Content-Length: " + std::to_string(*header_length) +
                           " bytes of JSON in a body of " + std::to_string(body->size()));
  }
  dom::parser parser;
  dom::element root;
  RETURN_IF_ERROR(ParseJson(&parser, *body, header_length.value_or(body->size()), limits, &root));
  out->set_model_name(model);
  out->set_model_version(version);
  return RequestOf(root, *body, header_length, out, form);
}

namespace {

// A tensor's bytes as a flat JSON array of its datatype's numbers, written in place.
void AppendData(std::string* s, const std::string& datatype, const char* p, size_t n) {
  const size_t size = datatype == "FP32" ? 4 : 2;
  const size_t count = n / size;
  const size_t start = s->size();
  // '[', each number and its comma, ']', and the room the last number may overwrite.
  s->resize(start + 2 + count * (kFloat32TextMax + 1) + kFloat32Room);
  char* out = s->data() + start;
  *out++ = '[';
  if (size == 4) {
    out = WriteFloat32List(out, p, count);  // Read where the answer lies.
  } else {
    constexpr size_t kChunk = 256;  // FP16 and BF16 widened to float32, a chunk at a time.
    float values[kChunk];
    for (size_t k = 0; k < count; k += kChunk) {
      const size_t m = std::min(kChunk, count - k);
      for (size_t i = 0; i < m; ++i) {
        uint16_t h = 0;
        std::memcpy(&h, p + (k + i) * 2, 2);
        values[i] = datatype == "FP16" ? HalfToFloat(h) : BFloat16ToFloat(h);
      }
      if (k > 0) *out++ = ',';
      out = WriteFloat32List(out, values, m);
    }
  }
  *out++ = ']';
  s->resize(static_cast<size_t>(out - s->data()));
}

}  // namespace

std::string JsonString(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string JsonError(const std::string& message) {
  return "{\"error\":" + JsonString(message) + "}";
}

void OipAnswerToHttp(const inference::ModelInferResponse& head, std::vector<AnswerBytes> raw,
                     const HttpAnswerForm& form, std::string* json, std::vector<AnswerBytes>* tail,
                     std::optional<size_t>* header_length) {
  std::string& s = *json;
  s = "{\"model_name\":" + JsonString(head.model_name()) +
      ",\"model_version\":" + JsonString(head.model_version());
  if (!head.id().empty()) s += ",\"id\":" + JsonString(head.id());
  s += ",\"outputs\":[";
  for (int i = 0; i < head.outputs_size(); ++i) {
    const auto& o = head.outputs(i);
    if (i > 0) s += ',';
    s += "{\"name\":" + JsonString(o.name()) + ",\"datatype\":" + JsonString(o.datatype()) +
         ",\"shape\":[";
    for (int d = 0; d < o.shape_size(); ++d) s += (d ? "," : "") + std::to_string(o.shape(d));
    s += ']';
    AnswerBytes bytes = i < static_cast<int>(raw.size()) ? std::move(raw[i]) : AnswerBytes{};
    const size_t n = bytes.size();
    if (n == 0) {
      // In a shared-memory region (or empty): no data here.
    } else if (form.Binary(o.name())) {
      s += ",\"parameters\":{\"binary_data_size\":" + std::to_string(n) + "}";
      tail->push_back(std::move(bytes));
    } else {
      s += ",\"data\":";
      AppendData(&s, o.datatype(), bytes.block ? bytes.block.data : bytes.own->data(), n);
    }
    s += '}';
  }
  s += "]}";
  if (tail->empty()) {
    header_length->reset();
  } else {
    *header_length = s.size();
  }
}

std::string JsonOfServerMetadata(const std::string& name, const std::string& version,
                                 const std::vector<std::string>& extensions) {
  nlohmann::json j = {{"name", name}, {"version", version}, {"extensions", extensions}};
  return j.dump();
}

std::string JsonOfModelMetadata(const inference::ModelMetadataResponse& m) {
  const auto tensors = [](const auto& list) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& t : list) {
      out.push_back({{"name", t.name()},
                     {"datatype", t.datatype()},
                     {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}});
    }
    return out;
  };
  nlohmann::json j = {
      {"name", m.name()},
      {"versions", std::vector<std::string>(m.versions().begin(), m.versions().end())},
      {"platform", m.platform()},
      {"inputs", tensors(m.inputs())},
      {"outputs", tensors(m.outputs())}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace attnserve
