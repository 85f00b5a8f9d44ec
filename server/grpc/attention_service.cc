#include "server/grpc/attention_service.h"

#include "server/grpc/grpc_call.h"
#include "server/grpc/grpc_codec.h"
#include "server/grpc/grpc_status.h"
#include "server/grpc/stream_reactor.h"

namespace attnserve {
namespace {

/// AttendStream's messages: AttendRequest in, AttendResponse out (an error travels in `error`).
class AttendStreamCodec final : public StreamCodec {
 public:
  /// `staging`: where requests' tensors are decoded to (a CUDA server's; null: the message).
  explicit AttendStreamCodec(HostStaging* staging) : staging_(staging) {}
  const char* method() const override { return "AttendStream"; }
  Status Decode(const grpc::ByteBuffer& bytes, std::unique_ptr<Exchange>* x, Status*,
                std::string*) override {
    *x = std::make_unique<Exchange>();
    return ParseRequest(bytes, &(*x)->request, staging_, &(*x)->staged);
  }
  grpc::ByteBuffer Encode(Exchange* x, const Status& status) override {
    if (status.ok()) return EncodeAnswer(&x->answer);
    v1::AttendResponse meta;
    meta.set_request_id(x->request.request_id());
    meta.mutable_error()->set_code(static_cast<int>(ToGrpcCode(status.code())));
    meta.mutable_error()->set_message(status.message());
    meta.mutable_error()->set_trace_id(x->trace.trace_id_hex());
    return EncodeResponse(meta, {}, nullptr);
  }

 private:
  HostStaging* staging_;
};

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(RequestPipeline& pipeline, CallCounter& calls)
    : pipeline_(pipeline),
      calls_(calls),
      stream_codec_(std::make_unique<AttendStreamCodec>(pipeline.staging())) {}

AttentionServiceImpl::~AttentionServiceImpl() = default;

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* req,
                                                       grpc::ByteBuffer* resp) {
  if (!req->Valid()) return NoMessage(pipeline_, calls_, ctx, "Attend", "AttendRequest");
  auto* reactor = NewUnaryReactor(calls_, ctx);  // Counted open from here, while it decodes too.
  auto x = std::make_unique<Exchange>();
  const Status parsed = ParseRequest(*req, &x->request, pipeline_.staging(), &x->staged);
  if (!parsed.ok()) {
    pipeline_.RecordUndecoded("Attend", parsed);
    reactor->Finish(ToGrpcStatus(parsed));
    return reactor;
  }
  Exchange* raw = x.release();
  pipeline_.Attend("Attend", raw, CallOf(ctx), [this, ctx, raw, reactor, resp](const Status& seen) {
    if (seen.ok()) *resp = EncodeAnswer(&raw->answer);
    pipeline_.Record("Attend", raw, seen);
    TellTraceOfFailure(ctx, raw->trace, seen);
    delete raw;
    reactor->Finish(ToGrpcStatus(seen));
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
  pipeline_.CreateMemory(*req, CallOf(ctx), resp,
                         [ctx, reactor](const Status& st, const CallTrace& trace) {
                           TellTraceOfFailure(ctx, trace, st);
                           reactor->Finish(ToGrpcStatus(st));
                         });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ForkSession(grpc::CallbackServerContext* ctx,
                                                            const v1::ForkSessionRequest* req,
                                                            v1::KvHandle* resp) {
  CallTrace traced;
  const Status st = pipeline_.ForkSession(*req, resp, TraceOf(ctx), &traced);
  return Finished(calls_, ctx, st, traced);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::TruncateSession(
    grpc::CallbackServerContext* ctx, const v1::TruncateSessionRequest* req, v1::KvHandle* resp) {
  CallTrace traced;
  const Status st = pipeline_.TruncateSession(*req, resp, TraceOf(ctx), &traced);
  return Finished(calls_, ctx, st, traced);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(grpc::CallbackServerContext* ctx,
                                                            const v1::OpenSessionRequest* req,
                                                            v1::KvHandle* resp) {
  CallTrace traced;
  const Status st = pipeline_.OpenSession(*req, resp, TraceOf(ctx), &traced);
  return Finished(calls_, ctx, st, traced);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DeleteMemory(grpc::CallbackServerContext* ctx,
                                                             const v1::ReleaseRequest* req,
                                                             v1::ReleaseResponse* resp) {
  CallTrace traced;
  const Status st =
      pipeline_.Release("DeleteMemory", KvKind::kMemory, *req, resp, TraceOf(ctx), &traced);
  return Finished(calls_, ctx, st, traced);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(grpc::CallbackServerContext* ctx,
                                                             const v1::ReleaseRequest* req,
                                                             v1::ReleaseResponse* resp) {
  CallTrace traced;
  const Status st =
      pipeline_.Release("CloseSession", KvKind::kSession, *req, resp, TraceOf(ctx), &traced);
  return Finished(calls_, ctx, st, traced);
}

}  // namespace attnserve
