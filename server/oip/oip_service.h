#pragma once

#include <memory>

#include "inference/grpc_service.grpc.pb.h"
#include "server/grpc/call_counter.h"
#include "server/pipeline/request_pipeline.h"
#include "server/protocol/oip_protocol.h"
#include "server/shm/shared_memory.h"

namespace attnserve {

/// The Open Inference Protocol v2 front end (inference.GRPCInferenceService, Triton's field
/// numbers): an adapter onto the RequestPipeline, so an OIP call is validated, batched, limited,
/// counted and drained exactly as the attnserve.v1 call it stands for, and its answer carries the
/// same bytes. ModelInfer takes raw messages: the inputs' bytes move into the request without a
/// copy, and the outputs' go out as slices of the engine's buffers. Thread-safe.
namespace oip_detail {
namespace g = inference;
using S = g::GRPCInferenceService;
// Every method of the service as a callback, ModelInfer and ModelStreamInfer on raw messages.
using Base = S::WithRawCallbackMethod_ModelStreamInfer<S::WithRawCallbackMethod_ModelInfer<
    S::WithCallbackMethod_ServerLive<S::WithCallbackMethod_ServerReady<
        S::WithCallbackMethod_ModelReady<S::WithCallbackMethod_ServerMetadata<
            S::WithCallbackMethod_ModelMetadata<S::WithCallbackMethod_SystemSharedMemoryStatus<
                S::WithCallbackMethod_SystemSharedMemoryRegister<
                    S::WithCallbackMethod_SystemSharedMemoryUnregister<
                        S::WithCallbackMethod_CudaSharedMemoryStatus<
                            S::WithCallbackMethod_CudaSharedMemoryRegister<
                                S::WithCallbackMethod_CudaSharedMemoryUnregister<
                                    S::Service>>>>>>>>>>>>>;
}  // namespace oip_detail

class OipServiceImpl final : public oip_detail::Base {
 public:
  /// Borrows the protocol's shared operations (with its pipeline, sequences and shared-memory
  /// regions) and the count of calls open, which must outlive the service.
  OipServiceImpl(OipProtocol& oip, CallCounter& calls);
  ~OipServiceImpl() override;

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* ctx,
                                       const inference::ServerLiveRequest*,
                                       inference::ServerLiveResponse* resp) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* ctx,
                                        const inference::ServerReadyRequest*,
                                        inference::ServerReadyResponse* resp) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* ctx,
                                       const inference::ModelReadyRequest* req,
                                       inference::ModelReadyResponse* resp) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* ctx,
                                           const inference::ServerMetadataRequest*,
                                           inference::ServerMetadataResponse* resp) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* ctx,
                                          const inference::ModelMetadataRequest* req,
                                          inference::ModelMetadataResponse* resp) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;
  /// ModelInfer's requests on one stream, each answered as soon as it is computed (a
  /// ModelStreamInferResponse; an error travels in error_message and the stream goes on). The steps
  /// of one sequence run one after another in the order sent; other requests run at once.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* ctx) override;

  // The shared-memory extension: regions registered, listed and unregistered by name.
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryStatusRequest* req,
      inference::SystemSharedMemoryStatusResponse* resp) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryRegisterRequest* req,
      inference::SystemSharedMemoryRegisterResponse* resp) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryUnregisterRequest* req,
      inference::SystemSharedMemoryUnregisterResponse* resp) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryStatusRequest* req,
      inference::CudaSharedMemoryStatusResponse* resp) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryRegisterRequest* req,
      inference::CudaSharedMemoryRegisterResponse* resp) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryUnregisterRequest* req,
      inference::CudaSharedMemoryUnregisterResponse* resp) override;

 private:
  class Stream;  // ModelStreamInfer's StreamCodec.

  OipProtocol& oip_;
  RequestPipeline& pipeline_;
  CallCounter& calls_;
  SharedMemoryRegistry& shm_;
  std::unique_ptr<Stream> stream_;
};

}  // namespace attnserve
