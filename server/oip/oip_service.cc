#include "server/oip/oip_service.h"

#include "server/grpc/grpc_call.h"
#include "server/grpc/grpc_codec.h"
#include "server/grpc/grpc_status.h"
#include "server/grpc/stream_reactor.h"
#include "server/protocol/oip_codec.h"

namespace attnserve {

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
    auto x = std::make_unique<OipExchange>();
    *refused = service_.oip_.Decode("ModelStreamInfer", &infer, call, x.get());
    if (refused->ok() && x->reply.sequence)
      *order = infer.model_name() + '\n' + x->reply.sequence->id;
    *out = std::move(x);
    return Status::Ok();
  }
  Status Prepare(attnserve::Exchange* x) override {
    return service_.oip_.BeginSequence(static_cast<OipExchange*>(x));
  }
  void Computed(attnserve::Exchange* x, const Status& seen) override {
    service_.oip_.EndSequence(*static_cast<OipExchange*>(x), seen);
  }
  grpc::ByteBuffer Encode(attnserve::Exchange* base, const Status& status) override {
    auto* x = static_cast<OipExchange*>(base);
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

OipServiceImpl::OipServiceImpl(OipProtocol& oip, CallCounter& calls)
    : oip_(oip),
      pipeline_(oip.pipeline()),
      calls_(calls),
      shm_(oip.shm()),
      stream_(std::make_unique<Stream>(*this)) {}

OipServiceImpl::~OipServiceImpl() = default;

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
  const StatusOr<bool> ready = oip_.ModelReady(req->name(), req->version());
  if (ready.ok()) resp->set_ready(*ready);
  return Finished(calls_, ctx, ready.status());
}

grpc::ServerUnaryReactor* OipServiceImpl::ServerMetadata(grpc::CallbackServerContext* ctx,
                                                         const inference::ServerMetadataRequest*,
                                                         inference::ServerMetadataResponse* resp) {
  resp->set_name("attnserve");
  resp->set_version(ATTNSERVE_VERSION);
  for (const std::string& e : oip_.Extensions()) resp->add_extensions(e);
  return Finished(calls_, ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelMetadata(grpc::CallbackServerContext* ctx,
                                                        const inference::ModelMetadataRequest* req,
                                                        inference::ModelMetadataResponse* resp) {
  StatusOr<inference::ModelMetadataResponse> m = oip_.ModelMetadata(req->name(), req->version());
  if (m.ok()) *resp = std::move(m).value();
  return Finished(calls_, ctx, m.status());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelInfer(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* req,
                                                     grpc::ByteBuffer* resp) {
  if (!req->Valid()) return NoMessage(pipeline_, calls_, ctx, "ModelInfer", "ModelInferRequest");
  auto* reactor = NewUnaryReactor(calls_, ctx);  // Counted open from here, while it decodes too.
  StatusOr<CallContext> call = CallOf(ctx, pipeline_);
  inference::ModelInferRequest infer;
  auto x = std::make_unique<OipExchange>();
  Status st = call.status();
  if (st.ok()) st = ParseMessage(*req, &infer);
  if (st.ok()) st = oip_.Decode("ModelInfer", &infer, *call, x.get());
  if (st.ok()) st = oip_.BeginSequence(x.get());
  if (!st.ok()) {
    pipeline_.RecordUndecoded("ModelInfer", st);
    reactor->Answer(ToGrpcStatus(st));
    return reactor;
  }
  AttendUnary(
      pipeline_, "ModelInfer", ctx, std::move(call).value(), reactor, std::move(x),
      [this, resp](Answered& answered) {
        auto* x = static_cast<OipExchange*>(answered.get());
        const Status& computed = answered.status();
        oip_.EndSequence(*x, computed);
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
