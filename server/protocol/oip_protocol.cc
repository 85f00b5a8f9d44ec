#include "server/protocol/oip_protocol.h"

#include "server/core/caught.h"
#include "server/protocol/caller.h"

namespace attnserve {

OipProtocol::OipProtocol(RequestPipeline& pipeline, SharedMemoryRegistry& shm, size_t max_sequences,
                         std::chrono::steady_clock::duration sequence_idle)
    : pipeline_(pipeline), shm_(shm), sequences_(max_sequences, sequence_idle) {}

Status OipProtocol::Decode(const char* method, inference::ModelInferRequest* infer,
                           const CallContext& call, OipExchange* x) {
  return Caught(method, [&] {
    const TenantRegions regions = RegionsOf(shm_, call, pipeline_);
    RETURN_IF_ERROR(OipToAttend(infer, &x->request, &x->reply, &regions,
                                pipeline_.flow().max_region_input_bytes));
    x->output_limits = OipOutputLimits(x->reply);
    // A sequence is its caller's: another tenant's sequence of the same id is another session.
    if (x->reply.sequence) x->reply.sequence->tenant = call.tenant;
    return Status::Ok();
  });
}

void OipProtocol::CloseSession(const std::string& handle, const std::string& tenant) {
  v1::ReleaseRequest req;
  req.set_handle(handle);
  v1::ReleaseResponse resp;
  pipeline_.Release("CloseSession", KvKind::kSession, req, &resp, KvCaller{{}, tenant}, nullptr);
}

Status OipProtocol::BeginSequence(OipExchange* x) {
  if (!x->reply.sequence) return Status::Ok();
  v1::AttendRequest& r = x->request;
  const auto open = [&]() -> StatusOr<std::string> {
    v1::OpenSessionRequest req;
    req.set_model(r.model());
    req.set_model_version(r.model_version());
    req.set_batch(OipBatchOf(r));
    v1::KvHandle handle;
    const KvCaller caller{{}, x->reply.sequence->tenant};
    RETURN_IF_ERROR(pipeline_.OpenSession(req, &handle, caller, nullptr));
    return handle.handle();
  };
  ASSIGN_OR_RETURN(
      *r.mutable_session(),
      sequences_.Begin(r.model(), *x->reply.sequence, open, [this, &x](const std::string& h) {
        CloseSession(h, x->reply.sequence->tenant);
      }));
  return Status::Ok();
}

void OipProtocol::EndSequence(const OipExchange& x, const Status& seen) {
  if (!x.reply.sequence) return;
  sequences_.Finish(
      x.request.model(), *x.reply.sequence, x.request.session(), seen,
      [this, &x](const std::string& h) { CloseSession(h, x.reply.sequence->tenant); });
}

std::vector<std::string> OipProtocol::Extensions() const {
  std::vector<std::string> out;
  if (shm_.allowed()) out.push_back("system_shared_memory");
  if (shm_.allowed() && shm_.cuda()) out.push_back("cuda_shared_memory");
  return out;
}

StatusOr<bool> OipProtocol::ModelReady(const std::string& name, const std::string& version) const {
  ASSIGN_OR_RETURN(const int64_t v, OipVersion(version));
  return pipeline_.Ready(name, v);
}

StatusOr<inference::ModelMetadataResponse> OipProtocol::ModelMetadata(
    const std::string& name, const std::string& version) const {
  ASSIGN_OR_RETURN(const int64_t v, OipVersion(version));
  std::vector<int64_t> versions;
  ASSIGN_OR_RETURN(const ModelSpec spec, pipeline_.Describe(name, v, &versions));
  return OipModelMetadata(spec, versions);
}

}  // namespace attnserve
