#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/batcher.h"
#include "server/engine/attention_model.h"
#include "server/kv_store.h"
#include "server/metrics.h"
#include "server/model_repository.h"

namespace attnserve {

/// Bounds on what requests in flight may hold (README "Limits").
struct FlowLimits {
  /// Request plus answer bytes of every request accepted and not yet answered, over all calls; a
  /// request that would go past it gets RESOURCE_EXHAUSTED (server flag --max-inflight-bytes).
  int64_t max_inflight_bytes = int64_t{1} << 30;
  /// Requests one AttendStream may have accepted and not yet answered; at the limit the server
  /// stops reading that stream until the client takes answers (--max-stream-inflight).
  int max_stream_requests = 32;
  /// The same bound in request plus answer bytes (--max-stream-inflight-bytes); one request over it
  /// still runs, alone.
  int64_t max_stream_bytes = int64_t{64} << 20;
};

/// One AttendRequest on its way through the service: the decoded request (the engine's views point
/// into it), the answer's buffers (the engine writes into them), and the encoded answer.
struct Exchange {
  v1::AttendRequest request;
  grpc::ByteBuffer encoded;  ///< The answer's wire bytes, once Dispatch's `done` reported success.
  std::string model;         ///< Metrics label: the loaded model's name, or "" when none.
  SteadyClock::time_point received;
  int64_t held_bytes = 0;    ///< Counted against FlowLimits::max_inflight_bytes until recorded.
  uint32_t previous_attempts = 0;  ///< gRPC retries before this attempt (unary Attend).
  bool recorded = false;
};

class StreamReactor;

/// A call's deadline on the steady clock (max when the client set none).
SteadyClock::time_point DeadlineOf(const grpc::CallbackServerContext* ctx);

/// The gRPC AttentionService on the callback API. Attend and AttendStream take raw messages, so the
/// service decodes them itself: a message that does not decode gets INVALID_ARGUMENT with the reason
/// (gRPC's own decoding would answer UNIMPLEMENTED with no message). Handlers only translate: the
/// request path is decode -> model lookup -> FromWire -> Validate -> Batcher -> engine -> encode.
/// Thread-safe.
class AttentionServiceImpl final
    : public v1::AttentionService::WithRawCallbackMethod_Attend<
          v1::AttentionService::WithRawCallbackMethod_AttendStream<
              v1::AttentionService::WithCallbackMethod_ListModels<
                  v1::AttentionService::WithCallbackMethod_GetModel<
                      v1::AttentionService::WithCallbackMethod_CreateMemory<
                          v1::AttentionService::WithCallbackMethod_DeleteMemory<
                              v1::AttentionService::WithCallbackMethod_OpenSession<
                                  v1::AttentionService::WithCallbackMethod_CloseSession<
                                      v1::AttentionService::Service>>>>>>>> {
 public:
  /// Borrows everything; all must outlive the service. Each request takes the repository's set of
  /// the moment it is dispatched, so a reload never changes a request already accepted.
  AttentionServiceImpl(const ModelRepository& models, Batcher& batcher, ServerMetrics& metrics,
                       const AttendLimits& limits, const FlowLimits& flow, KvStore& kv);
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
  grpc::ServerUnaryReactor* CreateMemory(grpc::CallbackServerContext* ctx, const v1::CreateMemoryRequest* req,
                                         v1::KvHandle* resp) override;
  grpc::ServerUnaryReactor* DeleteMemory(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* req,
                                         v1::ReleaseResponse* resp) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest* req,
                                        v1::KvHandle* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* req,
                                         v1::ReleaseResponse* resp) override;

  /// Starts the shutdown drain: from now on streams take no new requests (those read from an open
  /// stream, and new streams, get UNAVAILABLE) and every open stream finishes, with UNAVAILABLE, once
  /// its accepted requests are answered. Unary calls are still served: they end by themselves, and
  /// until gRPC stops, a proxy that does not watch health keeps sending them here. Idempotent.
  void BeginDrain();
  /// Waits until no request is in flight, no stream is open and no request has arrived for `quiet`,
  /// or until `deadline`; true when everything finished.
  bool WaitIdle(SteadyClock::time_point deadline, SteadyClock::duration quiet);

  /// The request path shared by Attend and AttendStream, for an exchange whose `request` is decoded.
  /// Counts it in flight. `done` runs exactly once, on any thread (possibly before Dispatch returns):
  /// with OK and `x->encoded` set, or with the failure. The caller then calls Record once the
  /// client's outcome is known. `x` must live until Record.
  void Dispatch(const char* method, Exchange* x, SteadyClock::time_point deadline,
                std::function<bool()> cancelled, std::function<void(const Status&)> done);
  /// Records a dispatched exchange's outcome as the client saw it (count, latency, in flight) and
  /// gives its bytes back. Once per exchange.
  void Record(const char* method, Exchange* x, const Status& seen);
  /// Counts a request that never reached Dispatch (it did not decode) as answered with `seen`.
  void RecordUndecoded(const char* method, const Status& seen);

  const FlowLimits& flow() const { return flow_; }
  bool draining() const { return draining_.load(); }

 private:
  friend class StreamReactor;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const char* method, KvKind kind,
                                    const std::string& handle, v1::ReleaseResponse* resp);
  void AddStream(StreamReactor* s);
  void RemoveStream(StreamReactor* s);

  const ModelRepository& models_;
  Batcher& batcher_;
  ServerMetrics& metrics_;
  const AttendLimits limits_;
  const FlowLimits flow_;
  KvStore& kv_;
  std::atomic<bool> draining_{false};

  std::mutex mu_;
  std::condition_variable idle_cv_;
  int64_t held_bytes_ = 0;  // Σ Exchange::held_bytes of requests not yet recorded.
  int64_t in_flight_ = 0;   // Dispatched and not yet recorded.
  SteadyClock::time_point last_arrival_;  // Latest request or stream received.
  std::set<StreamReactor*> streams_;
};

}  // namespace attnserve
