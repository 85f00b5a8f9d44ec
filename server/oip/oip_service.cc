#include "server/oip/oip_service.h"

#include "server/grpc/grpc_call.h"
#include "server/grpc/grpc_codec.h"
#include "server/grpc/grpc_status.h"
#include "server/grpc/stream_reactor.h"
#include "server/oip/oip_codec.h"

namespace attnserve {
// An OIP exchange: the pipeline's, plus what only the OIP answer carries.
struct OipServiceImpl::Exchange : attnserve::Exchange {
  OipReply reply;
};

// ModelStreamInfer: ModelInferRequest in, ModelStreamInferResponse out.
class OipServiceImpl::Stream final : public StreamCodec {
 public:
  explicit Stream(OipServiceImpl& service) : service_(service) {}
  const char* method() const override { return "ModelStreamInfer"; }

  Status Decode(const grpc::ByteBuffer& bytes, const CallContext& call,
                std::unique_ptr<attnserve::Exchange>* out, Status* refused,
                std::string* order) override {
    inference::ModelInferRequest infer;
    RETURN_IF_ERROR(ParseMessage(bytes, &infer));
    auto x = std::make_unique<Exchange>();
    *refused = service_.Decode(&infer, call, x.get());
    if (refused->ok() && x->reply.sequence)
      *order = infer.model_name() + '\n' + x->reply.sequence->id;
    *out = std::move(x);
    return Status::Ok();
  }
  Status Prepare(attnserve::Exchange* x) override {
    return service_.BeginSequence(static_cast<Exchange*>(x));
  }
  void Computed(attnserve::Exchange* x, const Status& seen) override {
    service_.EndSequence(*static_cast<Exchange*>(x), seen);
  }
  grpc::ByteBuffer Encode(attnserve::Exchange* base, const Status& status) override {
    auto* x = static_cast<Exchange*>(base);
    Status written = status.ok() ? OipWriteSharedOutputs(&x->answer, x->reply) : status;
    if (written.ok()) {
      return EncodeWithRawBytes(OipResponseHead(x->answer, x->reply),
                                inference::ModelInferResponse::kRawOutputContentsFieldNumber,
                                OipRawOutputs(&x->answer, x->reply),
                                inference::ModelStreamInferResponse::kInferResponseFieldNumber);
    }
    inference::ModelStreamInferResponse error =
        OipStreamError(x->request, x->reply, written, x->trace.trace_id_hex());
    return EncodeWithRawBytes(error, 0, {});
  }

 private:
  OipServiceImpl& service_;
};

OipServiceImpl::OipServiceImpl(RequestPipeline& pipeline, CallCounter& calls,
                               SharedMemoryRegistry& shm, size_t max_sequences,
                               std::chrono::steady_clock::duration sequence_idle)
    : pipeline_(pipeline),
      calls_(calls),
      shm_(shm),
      sequences_(max_sequences, sequence_idle),
      stream_(std::make_unique<Stream>(*this)) {}

OipServiceImpl::~OipServiceImpl() = default;

Status OipServiceImpl::Decode(inference::ModelInferRequest* infer, const CallContext& call,
                              Exchange* x) {
  return Caught("ModelInfer", [&] {
    const TenantRegions regions = RegionsOf(shm_, call, pipeline_);
    RETURN_IF_ERROR(OipToAttend(infer, &x->request, &x->reply, &regions,
                                pipeline_.flow().max_region_input_bytes));
    x->output_limits = OipOutputLimits(x->reply);
    // A sequence is its caller's: another tenant's sequence of the same id is another session.
    if (x->reply.sequence) x->reply.sequence->tenant = call.tenant;
    return Status::Ok();
  });
}

void OipServiceImpl::CloseSession(const std::string& handle, const std::string& tenant) {
  v1::ReleaseRequest req;
  req.set_handle(handle);
  v1::ReleaseResponse resp;
  pipeline_.Release("CloseSession", KvKind::kSession, req, &resp, KvCaller{{}, tenant}, nullptr);
}

Status OipServiceImpl::BeginSequence(Exchange* x) {
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

void OipServiceImpl::EndSequence(const Exchange& x, const Status& seen) {
  if (!x.reply.sequence) return;
  sequences_.Finish(
      x.request.model(), *x.reply.sequence, x.request.session(), seen,
      [this, &x](const std::string& h) { CloseSession(h, x.reply.sequence->tenant); });
}

grpc::ServerUnaryReactor* OipServiceImpl::ServerLive(grpc::CallbackServerContext* ctx,
                                                     const inference::ServerLiveRequest*,
                                                     inference::ServerLiveResponse* resp) {
  resp->set_live(true);
  return Finished(calls_, ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ServerReady(grpc::CallbackServerContext* ctx,
                                                      const inference::ServerReadyRequest*,
                                                      inference::ServerReadyResponse* resp) {
  resp->set_ready(pipeline_.Ready("", 0));
  return Finished(calls_, ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelReady(grpc::CallbackServerContext* ctx,
                                                     const inference::ModelReadyRequest* req,
                                                     inference::ModelReadyResponse* resp) {
  const StatusOr<int64_t> version = OipVersion(req->version());
  if (!version.ok()) return Finished(calls_, ctx, version.status());
  resp->set_ready(pipeline_.Ready(req->name(), *version));
  return Finished(calls_, ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ServerMetadata(grpc::CallbackServerContext* ctx,
                                                         const inference::ServerMetadataRequest*,
                                                         inference::ServerMetadataResponse* resp) {
  resp->set_name("attnserve");
  resp->set_version(ATTNSERVE_VERSION);
  if (shm_.allowed()) resp->add_extensions("system_shared_memory");
  if (shm_.allowed() && shm_.cuda()) resp->add_extensions("cuda_shared_memory");
  return Finished(calls_, ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelMetadata(grpc::CallbackServerContext* ctx,
                                                        const inference::ModelMetadataRequest* req,
                                                        inference::ModelMetadataResponse* resp) {
  const StatusOr<int64_t> version = OipVersion(req->version());
  if (!version.ok()) return Finished(calls_, ctx, version.status());
  std::vector<int64_t> versions;
  const StatusOr<ModelSpec> spec = pipeline_.Describe(req->name(), *version, &versions);
  if (spec.ok()) *resp = OipModelMetadata(*spec, versions);
  return Finished(calls_, ctx, spec.status());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelInfer(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* req,
                                                     grpc::ByteBuffer* resp) {
  if (!req->Valid()) return NoMessage(pipeline_, calls_, ctx, "ModelInfer", "ModelInferRequest");
  auto* reactor = NewUnaryReactor(calls_, ctx);  // Counted open from here, while it decodes too.
  StatusOr<CallContext> call = CallOf(ctx, pipeline_);
  inference::ModelInferRequest infer;
  auto x = std::make_unique<Exchange>();
  Status st = call.status();
  if (st.ok()) st = ParseMessage(*req, &infer);
  if (st.ok()) st = Decode(&infer, *call, x.get());
  if (st.ok()) st = BeginSequence(x.get());
  if (!st.ok()) {
    pipeline_.RecordUndecoded("ModelInfer", st);
    reactor->Answer(ToGrpcStatus(st));
    return reactor;
  }
  AttendUnary(
      pipeline_, "ModelInfer", ctx, std::move(call).value(), reactor, std::move(x),
      [this, resp](Answered& answered) {
        auto* x = static_cast<Exchange*>(answered.get());
        const Status& computed = answered.status();
        EndSequence(*x, computed);
        // Outputs asked for in regions go there; a region cut short meanwhile fails the call.
        const Status seen = computed.ok() ? OipWriteSharedOutputs(&x->answer, x->reply) : computed;
        if (seen.ok()) {
          *resp = EncodeWithRawBytes(OipResponseHead(x->answer, x->reply),
                                     inference::ModelInferResponse::kRawOutputContentsFieldNumber,
                                     OipRawOutputs(&x->answer, x->reply));
        }
        return seen;
      });
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* OipServiceImpl::ModelStreamInfer(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(pipeline_, calls_, *stream_, ctx);
}

grpc::ServerUnaryReactor* OipServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryStatusRequest* req,
    inference::SystemSharedMemoryStatusResponse* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "SystemSharedMemoryStatus",
                     [&](const CallContext& call, auto*) {
                       const StatusOr<std::vector<RegionInfo>> regions =
                           RegionsOf(shm_, call, pipeline_).List(req->name(), false);
                       if (regions.ok()) {
                         for (const RegionInfo& r : *regions) {
                           auto& status = (*resp->mutable_regions())[r.name];
                           status.set_name(r.name);
                           status.set_key(r.key);
                           status.set_offset(r.offset);
                           status.set_byte_size(r.byte_size);
                         }
                       }
                       return regions.status();
                     });
}

grpc::ServerUnaryReactor* OipServiceImpl::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryRegisterRequest* req,
    inference::SystemSharedMemoryRegisterResponse*) {
  return AnsweredFor(
      pipeline_, calls_, ctx, "SystemSharedMemoryRegister", [&](const CallContext& call, auto*) {
        return RegionsOf(shm_, call, pipeline_)
            .RegisterSystem(req->name(), req->key(), req->offset(), req->byte_size());
      });
}

grpc::ServerUnaryReactor* OipServiceImpl::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryUnregisterRequest* req,
    inference::SystemSharedMemoryUnregisterResponse*) {
  return AnsweredFor(
      pipeline_, calls_, ctx, "SystemSharedMemoryUnregister", [&](const CallContext& call, auto*) {
        return RegionsOf(shm_, call, pipeline_).Unregister(req->name(), /*cuda=*/false);
      });
}

grpc::ServerUnaryReactor* OipServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryStatusRequest* req,
    inference::CudaSharedMemoryStatusResponse* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "CudaSharedMemoryStatus",
                     [&](const CallContext& call, auto*) {
                       const StatusOr<std::vector<RegionInfo>> regions =
                           RegionsOf(shm_, call, pipeline_).List(req->name(), true);
                       if (regions.ok()) {
                         for (const RegionInfo& r : *regions) {
                           auto& status = (*resp->mutable_regions())[r.name];
                           status.set_name(r.name);
                           status.set_device_id(static_cast<uint64_t>(r.device));
                           status.set_byte_size(r.byte_size);
                         }
                       }
                       return regions.status();
                     });
}

grpc::ServerUnaryReactor* OipServiceImpl::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryRegisterRequest* req,
    inference::CudaSharedMemoryRegisterResponse*) {
  return AnsweredFor(
      pipeline_, calls_, ctx, "CudaSharedMemoryRegister", [&](const CallContext& call, auto*) {
        return RegionsOf(shm_, call, pipeline_)
            .RegisterCuda(req->name(), req->raw_handle(), req->device_id(), req->byte_size());
      });
}

grpc::ServerUnaryReactor* OipServiceImpl::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryUnregisterRequest* req,
    inference::CudaSharedMemoryUnregisterResponse*) {
  return AnsweredFor(
      pipeline_, calls_, ctx, "CudaSharedMemoryUnregister", [&](const CallContext& call, auto*) {
        return RegionsOf(shm_, call, pipeline_).Unregister(req->name(), /*cuda=*/true);
      });
}

}  // namespace attnserve
