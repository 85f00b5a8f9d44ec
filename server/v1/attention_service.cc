#include "server/v1/attention_service.h"

#include "server/grpc/grpc_call.h"
#include "server/grpc/grpc_codec.h"
#include "server/grpc/grpc_status.h"
#include "server/grpc/stream_reactor.h"
#include "server/v1/shared_tensors.h"

namespace attnserve {
namespace {

/// An attnserve.v1 exchange: the pipeline's, plus the shared-memory regions it reads and writes.
struct V1Exchange : Exchange {
  SharedTensors shared;
};

/// Decodes an AttendRequest into `x`: its tensors straight into staging on a CUDA server, those in
/// shared-memory regions read from them.
Status DecodeAttend(const grpc::ByteBuffer& bytes, RequestPipeline& pipeline,
                    SharedMemoryRegistry& shm, const CallContext& call, V1Exchange* x) {
  return Caught("Attend", [&] {
    RETURN_IF_ERROR(ParseRequest(bytes, &x->request, pipeline.staging(), &x->staged));
    if (!NamesSharedMemory(x->request)) return Status::Ok();
    return ReadSharedTensors(RegionsOf(shm, call, pipeline), pipeline.staging(), &x->request,
                             &x->staged, &x->shared, &x->output_limits,
                             pipeline.flow().max_region_input_bytes);
  });
}

/// AttendStream's messages: AttendRequest in, AttendResponse out (an error travels in `error`).
class AttendStreamCodec final : public StreamCodec {
 public:
  AttendStreamCodec(RequestPipeline& pipeline, SharedMemoryRegistry& shm)
      : pipeline_(pipeline), shm_(shm) {}
  const char* method() const override { return "AttendStream"; }
  Status Decode(const grpc::ByteBuffer& bytes, const CallContext& call,
                std::unique_ptr<Exchange>* out, Status* refused, std::string*) override {
    auto x = std::make_unique<V1Exchange>();
    const Status parsed = ParseRequest(bytes, &x->request, pipeline_.staging(), &x->staged);
    if (parsed.ok() && NamesSharedMemory(x->request)) {
      // A region that cannot be read refuses this request; the stream goes on.
      *refused = ReadSharedTensors(RegionsOf(shm_, call, pipeline_), pipeline_.staging(),
                                   &x->request, &x->staged, &x->shared, &x->output_limits,
                                   pipeline_.flow().max_region_input_bytes);
    }
    *out = std::move(x);
    return parsed;
  }
  grpc::ByteBuffer Encode(Exchange* base, const Status& computed) override {
    auto* x = static_cast<V1Exchange*>(base);
    const Status status =
        computed.ok() && x->shared.any() ? WriteSharedTensors(x->shared, &x->answer) : computed;
    if (status.ok()) return EncodeAnswer(&x->answer);
    v1::AttendResponse meta;
    meta.set_request_id(x->request.request_id());
    meta.mutable_error()->set_code(static_cast<int>(ToGrpcCode(status.code())));
    meta.mutable_error()->set_message(status.message());
    meta.mutable_error()->set_trace_id(x->trace.trace_id_hex());
    return EncodeResponse(meta, {}, nullptr);
  }

 private:
  RequestPipeline& pipeline_;
  SharedMemoryRegistry& shm_;
};

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(RequestPipeline& pipeline, CallCounter& calls,
                                           SharedMemoryRegistry& shm)
    : pipeline_(pipeline),
      calls_(calls),
      shm_(shm),
      stream_codec_(std::make_unique<AttendStreamCodec>(pipeline, shm)) {}

AttentionServiceImpl::~AttentionServiceImpl() = default;

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* req,
                                                       grpc::ByteBuffer* resp) {
  if (!req->Valid()) return NoMessage(pipeline_, calls_, ctx, "Attend", "AttendRequest");
  auto* reactor = NewUnaryReactor(calls_, ctx);  // Counted open from here, while it decodes too.
  StatusOr<CallContext> call = CallOf(ctx, pipeline_);
  auto x = std::make_unique<V1Exchange>();
  const Status parsed =
      call.ok() ? DecodeAttend(*req, pipeline_, shm_, *call, x.get()) : call.status();
  if (!parsed.ok()) {
    pipeline_.RecordUndecoded("Attend", parsed);
    reactor->Answer(ToGrpcStatus(parsed));
    return reactor;
  }
  AttendUnary(pipeline_, "Attend", ctx, std::move(call).value(), reactor, std::move(x),
              [resp](Answered& answered) {
                auto* x = static_cast<V1Exchange*>(answered.get());
                // An answer asked for in a region goes there; a region cut short meanwhile fails
                // the call.
                const Status& computed = answered.status();
                const Status seen = computed.ok() && x->shared.any()
                                        ? WriteSharedTensors(x->shared, &x->answer)
                                        : computed;
                if (seen.ok()) *resp = EncodeAnswer(&x->answer);
                return seen;
              });
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(pipeline_, calls_, *stream_codec_, ctx);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* ctx,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* resp) {
  pipeline_.ListModels(resp);
  return Finished(calls_, ctx, Status::Ok());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* ctx,
                                                         const v1::GetModelRequest* req,
                                                         v1::ModelInfo* resp) {
  return Finished(calls_, ctx, pipeline_.GetModel(*req, resp));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CreateMemory(grpc::CallbackServerContext* ctx,
                                                             const v1::CreateMemoryRequest* req,
                                                             v1::KvHandle* resp) {
  auto* reactor = NewUnaryReactor(calls_, ctx);
  StatusOr<CallContext> call = CallOf(ctx, pipeline_);
  // Keys and values in shared-memory regions: read into a copy of the request held until done.
  std::shared_ptr<v1::CreateMemoryRequest> copy;
  auto shared = std::make_shared<SharedTensors>();
  Status read = call.status();
  if (call.ok() && NamesSharedMemory(*req)) {
    read = Caught("CreateMemory", [&] {
      copy = std::make_shared<v1::CreateMemoryRequest>(*req);
      return ReadSharedTensors(RegionsOf(shm_, *call, pipeline_), copy.get(), shared.get(),
                               pipeline_.flow().max_region_input_bytes);
    });
  }
  if (!read.ok()) {
    reactor->Answer(ToGrpcStatus(read));
    return reactor;
  }
  pipeline_.CreateMemory(copy ? *copy : *req, std::move(call).value(), resp,
                         [ctx, reactor, copy, shared](const Status& st, const CallTrace& trace) {
                           TellTraceOfFailure(ctx, trace, st);
                           reactor->Answer(ToGrpcStatus(st));
                         });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ForkSession(grpc::CallbackServerContext* ctx,
                                                            const v1::ForkSessionRequest* req,
                                                            v1::KvHandle* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "ForkSession",
                     [&](const CallContext& call, auto* traced) {
                       return pipeline_.ForkSession(*req, resp, KvCallerOf(call), traced);
                     });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::TruncateSession(
    grpc::CallbackServerContext* ctx, const v1::TruncateSessionRequest* req, v1::KvHandle* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "TruncateSession",
                     [&](const CallContext& call, auto* traced) {
                       return pipeline_.TruncateSession(*req, resp, KvCallerOf(call), traced);
                     });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(grpc::CallbackServerContext* ctx,
                                                            const v1::OpenSessionRequest* req,
                                                            v1::KvHandle* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "OpenSession",
                     [&](const CallContext& call, auto* traced) {
                       return pipeline_.OpenSession(*req, resp, KvCallerOf(call), traced);
                     });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DeleteMemory(grpc::CallbackServerContext* ctx,
                                                             const v1::ReleaseRequest* req,
                                                             v1::ReleaseResponse* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "DeleteMemory",
                     [&](const CallContext& call, auto* traced) {
                       return pipeline_.Release("DeleteMemory", KvKind::kMemory, *req, resp,
                                                KvCallerOf(call), traced);
                     });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(grpc::CallbackServerContext* ctx,
                                                             const v1::ReleaseRequest* req,
                                                             v1::ReleaseResponse* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "CloseSession",
                     [&](const CallContext& call, auto* traced) {
                       return pipeline_.Release("CloseSession", KvKind::kSession, *req, resp,
                                                KvCallerOf(call), traced);
                     });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::RegisterSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::RegisterSharedMemoryRequest* req,
    v1::RegisterSharedMemoryResponse*) {
  return AnsweredFor(
      pipeline_, calls_, ctx, "RegisterSharedMemory", [&](const CallContext& call, auto*) {
        return RegionsOf(shm_, call, pipeline_)
            .RegisterSystem(req->name(), req->key(), req->offset(), req->byte_size());
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnregisterSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
    v1::UnregisterSharedMemoryResponse*) {
  return AnsweredFor(
      pipeline_, calls_, ctx, "UnregisterSharedMemory", [&](const CallContext& call, auto*) {
        return RegionsOf(shm_, call, pipeline_).Unregister(req->name(), /*cuda=*/false);
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::SharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const v1::SharedMemoryStatusRequest* req,
    v1::SharedMemoryStatusResponse* resp) {
  return AnsweredFor(pipeline_, calls_, ctx, "SharedMemoryStatus",
                     [&](const CallContext& call, auto*) {
                       const StatusOr<std::vector<RegionInfo>> regions =
                           RegionsOf(shm_, call, pipeline_).List(req->name(), false);
                       if (regions.ok()) {
                         for (const RegionInfo& r : *regions) {
                           v1::SharedMemoryRegion* out = resp->add_regions();
                           out->set_name(r.name);
                           out->set_key(r.key);
                           out->set_offset(r.offset);
                           out->set_byte_size(r.byte_size);
                         }
                       }
                       return regions.status();
                     });
}

}  // namespace attnserve
