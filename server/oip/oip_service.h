#pragma once

#include <memory>

#include "inference/grpc_service.grpc.pb.h"
#include "server/grpc/call_counter.h"
#include "server/oip/oip_sequences.h"
#include "server/pipeline/request_pipeline.h"

namespace attnserve {

/// The Open Inference Protocol v2 front end (inference.GRPCInferenceService, Triton's field
/// numbers): an adapter onto the RequestPipeline, so an OIP call is validated, batched, limited,
/// counted and drained exactly as the attnserve.v1 call it stands for, and its answer carries the
/// same bytes. ModelInfer takes raw messages: the inputs' bytes move into the request without a
/// copy, and the outputs' go out as slices of the engine's buffers. Thread-safe.
class OipServiceImpl final
    : public inference::GRPCInferenceService::WithRawCallbackMethod_ModelStreamInfer<
          inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
              inference::GRPCInferenceService::WithCallbackMethod_ServerLive<
                  inference::GRPCInferenceService::WithCallbackMethod_ServerReady<
                      inference::GRPCInferenceService::WithCallbackMethod_ModelReady<
                          inference::GRPCInferenceService::WithCallbackMethod_ServerMetadata<
                              inference::GRPCInferenceService::WithCallbackMethod_ModelMetadata<
                                  inference::GRPCInferenceService::Service>>>>>>> {
 public:
  /// Borrows the pipeline and the count of calls open, which must outlive the service. Triton's
  /// sequences are sessions: at most `max_sequences` at once, forgotten after `sequence_idle`
  /// unused (the sessions' TTL).
  OipServiceImpl(RequestPipeline& pipeline, CallCounter& calls, size_t max_sequences,
                 std::chrono::steady_clock::duration sequence_idle);
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

 private:
  struct Exchange;
  class Stream;  // ModelStreamInfer's StreamCodec.
  // A sequence's session for the request (opened at its start), named in its `session`.
  Status BeginSequence(Exchange* x);
  // After the step: the sequence's end closes its session.
  void EndSequence(const Exchange& x, const Status& seen);
  void CloseSession(const std::string& handle);

  RequestPipeline& pipeline_;
  CallCounter& calls_;
  OipSequences sequences_;
  std::unique_ptr<Stream> stream_;
};

}  // namespace attnserve
