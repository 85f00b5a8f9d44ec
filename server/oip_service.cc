#include "server/oip_service.h"

#include "server/grpc_call.h"
#include "server/grpc_codec.h"
#include "server/grpc_status.h"
#include "server/oip_codec.h"

namespace attnserve {
namespace {

grpc::ServerUnaryReactor* Finished(grpc::CallbackServerContext* ctx, const Status& st) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(st));
  return reactor;
}

// An OIP exchange: the pipeline's, plus what only the OIP answer carries.
struct OipExchange : Exchange {
  OipReply reply;
};

}  // namespace

OipServiceImpl::OipServiceImpl(RequestPipeline& pipeline) : pipeline_(pipeline) {}

grpc::ServerUnaryReactor* OipServiceImpl::ServerLive(grpc::CallbackServerContext* ctx,
                                                     const inference::ServerLiveRequest*,
                                                     inference::ServerLiveResponse* resp) {
  resp->set_live(true);
  return Finished(ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ServerReady(grpc::CallbackServerContext* ctx,
                                                      const inference::ServerReadyRequest*,
                                                      inference::ServerReadyResponse* resp) {
  resp->set_ready(pipeline_.Ready("", 0));
  return Finished(ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelReady(grpc::CallbackServerContext* ctx,
                                                     const inference::ModelReadyRequest* req,
                                                     inference::ModelReadyResponse* resp) {
  const StatusOr<int64_t> version = OipVersion(req->version());
  if (!version.ok()) return Finished(ctx, version.status());
  resp->set_ready(pipeline_.Ready(req->name(), *version));
  return Finished(ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ServerMetadata(grpc::CallbackServerContext* ctx,
                                                         const inference::ServerMetadataRequest*,
                                                         inference::ServerMetadataResponse* resp) {
  resp->set_name("attnserve");
  resp->set_version(ATTNSERVE_VERSION);
  return Finished(ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelMetadata(grpc::CallbackServerContext* ctx,
                                                        const inference::ModelMetadataRequest* req,
                                                        inference::ModelMetadataResponse* resp) {
  const StatusOr<int64_t> version = OipVersion(req->version());
  if (!version.ok()) return Finished(ctx, version.status());
  std::vector<int64_t> versions;
  const StatusOr<ModelSpec> spec = pipeline_.Describe(req->name(), *version, &versions);
  if (spec.ok()) *resp = OipModelMetadata(*spec, versions);
  return Finished(ctx, spec.status());
}

grpc::ServerUnaryReactor* OipServiceImpl::ModelInfer(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* req,
                                                     grpc::ByteBuffer* resp) {
  inference::ModelInferRequest infer;
  auto x = std::make_unique<OipExchange>();
  Status st = ParseMessage(*req, &infer);
  if (st.ok()) st = OipToAttend(&infer, &x->request, &x->reply);
  if (!st.ok()) {
    pipeline_.RecordUndecoded("ModelInfer", st);
    return Finished(ctx, st);
  }
  auto* reactor = ctx->DefaultReactor();
  OipExchange* raw = x.release();
  pipeline_.Attend("ModelInfer", raw, CallOf(ctx), [this, raw, reactor, resp](const Status& seen) {
    if (seen.ok()) {
      *resp = EncodeWithRawBytes(OipResponseHead(raw->answer, raw->reply),
                                 inference::ModelInferResponse::kRawOutputContentsFieldNumber,
                                 OipRawOutputs(&raw->answer, raw->reply));
    }
    pipeline_.Record("ModelInfer", raw, seen);
    delete raw;
    reactor->Finish(ToGrpcStatus(seen));
  });
  return reactor;
}

}  // namespace attnserve
