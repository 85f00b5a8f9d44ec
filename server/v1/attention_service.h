#pragma once

#include <memory>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/grpc/call_counter.h"
#include "server/pipeline/request_pipeline.h"
#include "server/shm/shared_memory.h"

namespace attnserve {

class StreamCodec;

/// The gRPC AttentionService on the callback API: each handler decodes, hands the request to the
/// RequestPipeline and encodes what comes back; it decides nothing. Attend and AttendStream take
/// raw messages, so the service decodes them itself: a message that does not decode gets
/// INVALID_ARGUMENT with the reason (gRPC's own decoding would answer UNIMPLEMENTED with no
/// message). Thread-safe.
namespace v1_detail {
using S = v1::AttentionService;
// Every method as a callback; Attend and AttendStream on raw messages.
using Base = S::WithRawCallbackMethod_Attend<
    S::WithRawCallbackMethod_AttendStream<S::WithCallbackMethod_ListModels<
        S::WithCallbackMethod_GetModel<S::WithCallbackMethod_CreateMemory<
            S::WithCallbackMethod_DeleteMemory<S::WithCallbackMethod_OpenSession<
                S::WithCallbackMethod_CloseSession<S::WithCallbackMethod_TruncateSession<
                    S::WithCallbackMethod_ForkSession<S::WithCallbackMethod_RegisterSharedMemory<
                        S::WithCallbackMethod_UnregisterSharedMemory<
                            S::WithCallbackMethod_SharedMemoryStatus<S::Service>>>>>>>>>>>>>;
}  // namespace v1_detail

class AttentionServiceImpl final : public v1_detail::Base {
 public:
  /// Borrows the pipeline, the count of calls open and the shared-memory regions, which must
  /// outlive the service.
  AttentionServiceImpl(RequestPipeline& pipeline, CallCounter& calls, SharedMemoryRegistry& shm);
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
  grpc::ServerUnaryReactor* RegisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                 const v1::RegisterSharedMemoryRequest* req,
                                                 v1::RegisterSharedMemoryResponse* resp) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
      v1::UnregisterSharedMemoryResponse* resp) override;
  grpc::ServerUnaryReactor* SharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                               const v1::SharedMemoryStatusRequest* req,
                                               v1::SharedMemoryStatusResponse* resp) override;

 private:
  RequestPipeline& pipeline_;
  CallCounter& calls_;
  SharedMemoryRegistry& shm_;
  std::unique_ptr<StreamCodec> stream_codec_;  // AttendStream's messages.
};

}  // namespace attnserve
