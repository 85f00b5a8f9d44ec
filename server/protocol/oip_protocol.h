#pragma once
// The Open Inference Protocol's operations that both of its front ends perform alike (gRPC's
// inference.GRPCInferenceService in server/oip/, HTTP/REST in server/http/): a decoded request
// for the pipeline, Triton's sequences onto sessions, readiness, metadata and the extensions
// offered. No transport in it.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "inference/grpc_service.pb.h"
#include "server/pipeline/request_pipeline.h"
#include "server/protocol/oip_codec.h"
#include "server/protocol/oip_sequences.h"
#include "server/shm/shared_memory.h"

namespace attnserve {

/// An OIP exchange: the pipeline's, plus what only the OIP answer carries.
struct OipExchange : Exchange {
  OipReply reply;
};

/// Thread-safe; borrows the pipeline and the shared-memory regions, which must outlive it.
class OipProtocol {
 public:
  /// Triton's sequences are sessions: at most `max_sequences` at once, forgotten after
  /// `sequence_idle` unused (the sessions' TTL).
  OipProtocol(RequestPipeline& pipeline, SharedMemoryRegistry& shm, size_t max_sequences,
              std::chrono::steady_clock::duration sequence_idle);

  RequestPipeline& pipeline() const { return pipeline_; }
  SharedMemoryRegistry& shm() const { return shm_; }

  /// `infer` decoded into `x` for the pipeline: its inputs read (regions of `call`'s tenant), its
  /// outputs' regions noted, its sequence its caller's. A throw is INTERNAL naming `method`.
  Status Decode(const char* method, inference::ModelInferRequest* infer, const CallContext& call,
                OipExchange* x);
  /// A sequence's session for the request (opened at its start), named in its `session`.
  Status BeginSequence(OipExchange* x);
  /// After the step: the sequence's end closes its session.
  void EndSequence(const OipExchange& x, const Status& seen);

  /// What the server metadata lists: "system_shared_memory" when shared memory is allowed, and
  /// "cuda_shared_memory" when CUDA regions are too.
  std::vector<std::string> Extensions() const;
  /// Whether `name` at `version` ("" the highest) is served now; INVALID_ARGUMENT for a version
  /// that is not a number.
  StatusOr<bool> ModelReady(const std::string& name, const std::string& version) const;
  /// A loaded model version's metadata (NOT_FOUND naming what is loaded).
  StatusOr<inference::ModelMetadataResponse> ModelMetadata(const std::string& name,
                                                           const std::string& version) const;

 private:
  void CloseSession(const std::string& handle, const std::string& tenant);

  RequestPipeline& pipeline_;
  SharedMemoryRegistry& shm_;
  OipSequences sequences_;
};

}  // namespace attnserve
