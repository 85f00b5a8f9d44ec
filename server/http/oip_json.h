#pragma once
// The Open Inference Protocol's HTTP/REST bodies to and from its messages: an infer request's JSON
// (tensors as JSON numbers, or as bytes after the JSON: the binary tensor data extension) as the
// ModelInferRequest the gRPC front end would have received for the same call, and an answer as
// JSON (and bytes). No HTTP server in it: the fuzz target drives it with any bytes.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "inference/grpc_service.pb.h"
#include "server/core/status.h"
#include "server/core/wire.h"

namespace attnserve {

/// Bounds on a JSON body beyond its size (which the HTTP server bounds before reading it).
struct JsonLimits {
  /// Nesting of arrays and objects (a deeper body is refused while parsing, without recursion).
  size_t max_depth = 64;
};

/// What the request asked of its answer's encoding (the binary tensor data extension): every
/// output's bytes after the JSON (`parameters.binary_data_output`), or per output
/// (`outputs[i].parameters.binary_data`, which wins).
struct HttpAnswerForm {
  bool binary_default = false;
  std::map<std::string, bool> binary;
  bool Binary(const std::string& output) const {
    auto it = binary.find(output);
    return it != binary.end() ? it->second : binary_default;
  }
};

/// `body` (its first `header_length` bytes JSON and the rest the inputs' bytes in order, or all
/// JSON when there is no Inference-Header-Content-Length) for model `model` at `version` (from the
/// path) as a ModelInferRequest: JSON data as the raw bytes of its datatype (FP32, FP16 and BF16
/// from numbers, BOOL from true/false, INT64 from integers; nested or flat, row-major), binary data
/// moved into raw_input_contents (one copy), parameters of their JSON kinds. INVALID_ARGUMENT
/// naming the field (inputs[0].data[7]), what arrived and what is allowed. `body`'s capacity
/// should reach SIMDJSON_PADDING (64) bytes past its size, else the JSON is copied once to parse.
Status HttpInferToOip(std::string* body, std::optional<size_t> header_length,
                      const std::string& model, const std::string& version,
                      const JsonLimits& limits, inference::ModelInferRequest* out,
                      HttpAnswerForm* form);

/// An answer as the body's JSON `json` and the bytes that follow it (`tail`: the outputs asked
/// for in binary, in order, not copied); `header_length` is the JSON's size when a tail follows
/// (the Inference-Header-Content-Length header), else nothing. Numbers are written so that each
/// reads back as the same float32 (the shortest such form); NaN and infinities as NaN, Infinity,
/// -Infinity (as Python's json reads them).
void OipAnswerToHttp(const inference::ModelInferResponse& head, std::vector<AnswerBytes> raw,
                     const HttpAnswerForm& form, std::string* json, std::vector<AnswerBytes>* tail,
                     std::optional<size_t>* header_length);

/// A shared-memory registration's body: {"key": "/name", "offset": N, "byte_size": N} (offset
/// optional, 0).
struct RegionRegistration {
  std::string key;
  uint64_t offset = 0, byte_size = 0;
};
StatusOr<RegionRegistration> HttpRegistrationOf(std::string* body, const JsonLimits& limits);

/// {"error": message}.
std::string JsonError(const std::string& message);
/// A JSON string literal of `s`, escaped.
std::string JsonString(const std::string& s);
/// Metadata answers.
std::string JsonOfServerMetadata(const std::string& name, const std::string& version,
                                 const std::vector<std::string>& extensions);
std::string JsonOfModelMetadata(const inference::ModelMetadataResponse& m);

}  // namespace attnserve
