// A request message as the server receives it, on both front ends: decoded as an attnserve.v1
// AttendRequest (ParseRequest), and as an Open Inference Protocol ModelInferRequest mapped onto one
// (OipToAttend); then FromWire and Validate against models of several shapes, with small limits so
// the refusal paths are reached too. The staged decode (a CUDA server's: tensors straight into
// staging) must agree with the plain one on every input: the same status and message, and the same
// message once the staged bytes are put back; it aborts otherwise.
#include <grpcpp/support/byte_buffer.h>

#include <cstdio>
#include <cstdlib>

#include "server/core/validator.h"
#include "server/core/wire.h"
#include "server/grpc/grpc_codec.h"
#include "server/protocol/oip_codec.h"

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

// The staged decode of `bytes` against the plain one (`plain`, `plain_status`).
void CheckStagedDecode(const grpc::ByteBuffer& bytes, const attnserve::pb::AttendRequest& plain,
                       const attnserve::Status& plain_status) {
  static attnserve::HostStaging staging(int64_t{1} << 26, /*pinned=*/false);
  attnserve::pb::AttendRequest staged_request;
  attnserve::StagedInputs staged;
  const attnserve::Status st = attnserve::ParseRequest(bytes, &staged_request, &staging, &staged);
  const auto put = [](const attnserve::BlockBytes& b, attnserve::pb::Tensor* t) {
    if (b) t->set_data(std::string(b.data, b.size));
  };
  if (staged.query) put(staged.query, staged_request.mutable_query());
  if (staged.key) put(staged.key, staged_request.mutable_key());
  if (staged.value) put(staged.value, staged_request.mutable_value());
  const bool same = st.code() == plain_status.code() && st.message() == plain_status.message() &&
                    (!st.ok() || staged_request.SerializeAsString() == plain.SerializeAsString());
  if (!same) {
    std::fprintf(stderr, "staged decode differs: %s / %s\n", st.message().c_str(),
                 plain_status.message().c_str());
    std::abort();
  }
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
  const attnserve::Status native_status = attnserve::ParseRequest(bytes, &native);
  CheckStagedDecode(bytes, native, native_status);
  for (const attnserve::pb::AttendRequest* request : {&native, &mapped}) {
    if (request == &native && !native_status.ok()) continue;
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
  // A batched step's entries, as the pipeline reads each: a session's step or a memory's query,
  // validated against each model as a session of batch 1 holding a few tokens.
  if (native_status.ok() && native.steps_size() > 0) {
    (void)attnserve::CheckBatchedStep(native);
    for (int i = 0; i < native.steps_size() && i < 64; ++i) {
      for (const auto& spec : specs) {
        attnserve::AttendCall call;
        if (!attnserve::FromWire(native.steps(i), "steps[" + std::to_string(i) + "]", &call).ok())
          break;
        call.kv_use = native.steps(i).session().empty() ? attnserve::AttendCall::Kv::kMemory
                                                        : attnserve::AttendCall::Kv::kSession;
        call.kv_batch = 1;
        call.kv_length = 3;
        attnserve::AttendLimits limits;
        limits.max_tokens = 4096;
        limits.max_attention_scores = 1 << 20;
        (void)attnserve::Validate(spec, limits, &call);
      }
    }
  }
  return 0;
}
