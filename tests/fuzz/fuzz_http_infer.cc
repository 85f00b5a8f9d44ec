// An HTTP infer request's body as the server receives it: its first byte picks whether it has an
// Inference-Header-Content-Length (and the next two bytes its value), the rest is the body. Decoded
// by HttpInferToOip into the ModelInferRequest the gRPC front end would take, then mapped by
// OipToAttend and validated against a model; an answer of the request's shapes is encoded back as
// JSON (and binary) and must parse as JSON again. Any crash, leak or sanitizer report fails.
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "server/core/validator.h"
#include "server/core/wire.h"
#include "server/http/oip_json.h"
#include "server/protocol/oip_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const bool binary = data[0] & 1;
  const size_t header = (static_cast<size_t>(data[1]) << 8) | data[2];
  std::string body;
  body.reserve(size + 64);
  body.assign(reinterpret_cast<const char*>(data + 3), size - 3);
  std::optional<size_t> header_length;
  if (binary) header_length = std::min(header, body.size());
  inference::ModelInferRequest infer;
  attnserve::HttpAnswerForm form;
  const attnserve::Status st =
      attnserve::HttpInferToOip(&body, header_length, "fuzz", "", {}, &infer, &form);
  if (!st.ok()) {
    if (st.message().empty()) std::abort();  // Every refusal says why.
    return 0;
  }
  attnserve::pb::AttendRequest request;
  attnserve::OipReply reply;
  if (!attnserve::OipToAttend(&infer, &request, &reply).ok()) return 0;
  attnserve::ModelSpec spec;
  spec.name = "fuzz";
  spec.embed_dim = 8;
  spec.num_heads = 2;
  spec.kdim = spec.vdim = 8;
  attnserve::AttendLimits limits;
  limits.max_tokens = 64;
  limits.max_attention_scores = 4096;
  attnserve::AttendCall call;
  if (attnserve::FromWire(request, &call).ok()) (void)attnserve::Validate(spec, limits, &call);
  // An answer with one output of a few floats, encoded as the request asked.
  inference::ModelInferResponse head;
  head.set_model_name("fuzz");
  head.set_model_version("1");
  head.set_id(infer.id());
  auto* o = head.add_outputs();
  o->set_name(attnserve::oip::kOutput);
  o->set_datatype("FP32");
  o->add_shape(2);
  std::vector<attnserve::AnswerBytes> raw(1);
  raw[0].own = std::make_unique<std::string>(8, '\x7f');
  std::string json;
  std::vector<attnserve::AnswerBytes> tail;
  std::optional<size_t> answer_header;
  attnserve::OipAnswerToHttp(head, std::move(raw), form, &json, &tail, &answer_header);
  if (!nlohmann::json::accept(json, /*ignore_comments=*/false) &&
      json.find("NaN") == std::string::npos)
    std::abort();  // The answer's JSON must be JSON (NaN aside, written as Python reads it).
  return 0;
}
