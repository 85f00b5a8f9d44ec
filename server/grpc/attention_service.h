#pragma once

#include <memory>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/grpc/call_counter.h"
#include "server/pipeline/request_pipeline.h"

namespace attnserve {

class StreamCodec;

/// The gRPC AttentionService on the callback API: each handler decodes, hands the request to the
/// RequestPipeline and encodes what comes back; it decides nothing. Attend and AttendStream take
/// raw messages, so the service decodes them itself: a message that does not decode gets
/// INVALID_ARGUMENT with the reason (gRPC's own decoding would answer UNIMPLEMENTED with no
/// message). Thread-safe.
class AttentionServiceImpl final
    : public v1::AttentionService::WithRawCallbackMethod_Attend<
          v1::AttentionService::WithRawCallbackMethod_AttendStream<
              v1::AttentionService::WithCallbackMethod_ListModels<
                  v1::AttentionService::WithCallbackMethod_GetModel<
                      v1::AttentionService::WithCallbackMethod_CreateMemory<
                          v1::AttentionService::WithCallbackMethod_DeleteMemory<
                              v1::AttentionService::WithCallbackMethod_OpenSession<
                                  v1::AttentionService::WithCallbackMethod_CloseSession<
                                      v1::AttentionService::WithCallbackMethod_TruncateSession<
                                          v1::AttentionService::WithCallbackMethod_ForkSession<
                                              v1::AttentionService::Service>>>>>>>>>> {
 public:
  /// Borrows the pipeline and the count of calls open, which must outlive the service.
  AttentionServiceImpl(RequestPipeline& pipeline, CallCounter& calls);
  ~AttentionServiceImpl() override;

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                   grpc::ByteBuffer* resp) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* req,
                                       v1::ListModelsResponse* resp) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* ctx,
                                     const v1::GetModelRequest* req, v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* CreateMemory(grpc::CallbackServerContext* ctx,
                                         const v1::CreateMemoryRequest* req,
                                         v1::KvHandle* resp) override;
  grpc::ServerUnaryReactor* DeleteMemory(grpc::CallbackServerContext* ctx,
                                         const v1::ReleaseRequest* req,
                                         v1::ReleaseResponse* resp) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* ctx,
                                        const v1::ForkSessionRequest* req,
                                        v1::KvHandle* resp) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* ctx,
                                            const v1::TruncateSessionRequest* req,
                                            v1::KvHandle* resp) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const v1::OpenSessionRequest* req,
                                        v1::KvHandle* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::ReleaseRequest* req,
                                         v1::ReleaseResponse* resp) override;

 private:
  RequestPipeline& pipeline_;
  CallCounter& calls_;
  std::unique_ptr<StreamCodec> stream_codec_;  // AttendStream's messages.
};

}  // namespace attnserve
