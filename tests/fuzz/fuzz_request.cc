// A request message as the server receives it, on both front ends: decoded as an attnserve.v1
// AttendRequest (ParseRequest), and as an Open Inference Protocol ModelInferRequest mapped onto one
// (OipToAttend); then FromWire and Validate against models of several shapes, with small limits so
// the refusal paths are reached too.
#include <grpcpp/support/byte_buffer.h>

#include "server/core/validator.h"
#include "server/core/wire.h"
#include "server/grpc/grpc_codec.h"
#include "server/oip/oip_codec.h"

namespace {

attnserve::ModelSpec Spec(int64_t e, int64_t h, int64_t kdim, bool bias_kv, bool zero_attn) {
  attnserve::ModelSpec s;
  s.name = "fuzz";
  s.embed_dim = e;
  s.num_heads = h;
  s.kdim = s.vdim = kdim;
  s.add_bias_kv = bias_kv;
  s.add_zero_attn = zero_attn;
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const attnserve::ModelSpec specs[] = {
      Spec(16, 4, 16, false, false), Spec(8, 2, 6, true, true), Spec(512, 8, 512, false, false)};
  grpc::Slice slice(data, size);
  const grpc::ByteBuffer bytes(&slice, 1);
  attnserve::pb::AttendRequest native;
  inference::ModelInferRequest oip;
  attnserve::pb::AttendRequest mapped;
  attnserve::OipReply reply;
  const bool oip_ok = attnserve::ParseMessage(bytes, &oip).ok() &&
                      attnserve::OipToAttend(&oip, &mapped, &reply).ok();
  for (const attnserve::pb::AttendRequest* request : {&native, &mapped}) {
    if (request == &native && !attnserve::ParseRequest(bytes, &native).ok()) continue;
    if (request == &mapped && !oip_ok) continue;
    for (const auto& spec : specs) {
      attnserve::AttendCall call;
      if (!attnserve::FromWire(*request, &call).ok()) break;
      attnserve::AttendLimits limits;
      limits.max_tokens = 4096;
      limits.max_attention_scores = 1 << 20;
      limits.max_answer_bytes = 1 << 20;
      (void)attnserve::Validate(spec, limits, &call);
    }
  }
  return 0;
}
