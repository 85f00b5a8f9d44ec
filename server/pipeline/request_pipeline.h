#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "attnserve/v1/attention.pb.h"
#include "server/core/wire.h"
#include "server/kv/kv_store.h"
#include "server/models/model_repository.h"
#include "server/pipeline/batcher.h"
#include "server/pipeline/metrics.h"
#include "server/tenants/tenants.h"
#include "server/trace/access_log.h"
#include "server/trace/tracer.h"

namespace attnserve {

/// Bounds on what requests in flight may hold (docs/shutdown.md "Limits").
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

/// What the pipeline needs to know of the call a request came on, in no front end's terms.
struct CallContext {
  /// When the client stops waiting (steady clock; max: never).
  SteadyClock::time_point deadline = SteadyClock::time_point::max();
  /// True once the client has cancelled; polled while the request waits and after compute. Empty:
  /// never.
  std::function<bool()> cancelled;
  /// Earlier attempts of this call under the client's retry policy (reported in the answer).
  uint32_t previous_attempts = 0;
  /// The caller's W3C trace context (the call's `traceparent`/`tracestate` metadata).
  IncomingTrace trace;
  /// Who is calling (the front end's TenantOf: a verified certificate's name, a trusted header's
  /// value, or "default").
  std::string tenant = kDefaultTenant;

  bool IsCancelled() const { return cancelled && cancelled(); }
};

/// Who calls one of the kept keys' and values' methods, and the trace the call joins.
struct KvCaller {
  IncomingTrace trace;
  std::string tenant = kDefaultTenant;  ///< Only it may use what it made.
};

/// One AttendRequest on its way through the pipeline: the decoded request (the engine's views
/// point into it) and, once the pipeline reported success, its answer.
struct Exchange {
  virtual ~Exchange() = default;  // Front ends extend it with what their answers carry.
  v1::AttendRequest request;
  /// The request's tensors decoded straight into pinned staging (CUDA; empty otherwise): the
  /// engine reads them there; given back once the request is computed.
  StagedInputs staged;
  /// Where the answer must fit when the front end writes it to memory the caller gave (a
  /// shared-memory region); checked once the request is validated, before compute.
  OutputLimits output_limits;
  AttendAnswer answer;
  std::string model;  ///< Metrics label: the loaded model's name, or "" when none.
  /// Who asked (CallContext::tenant), its metrics label, and the priority level it was queued at.
  std::string tenant = kDefaultTenant, tenant_label = kDefaultTenant;
  int64_t level = 0;
  SteadyClock::time_point received = SteadyClock::now();
  int64_t held_bytes = 0;  ///< Counted against FlowLimits::max_inflight_bytes until recorded.
  bool recorded = false;
  /// Its trace (docs/tracing.md) and the times its spans take: decoded and admitted, computed (the
  /// batch's host times), answered (the pipeline told the front end).
  CallTrace trace;
  struct Times {
    SteadyClock::time_point admitted, started, finished, answered;
    TraceId batch_trace{};
    SpanId batch_span{};
    int batch_size = 0;
    int64_t tokens = 0;
    uint32_t attempts = 0;
  } times;
};

/// A call that stays open across requests (an AttendStream), which the drain must close.
class OpenCall {
 public:
  virtual ~OpenCall() = default;
  /// Runs under the pipeline's lock when the drain begins: take no more requests. True when that
  /// leaves the call with nothing to do; the pipeline then calls FinishNow, after its lock.
  virtual bool Drain() = 0;
  /// Ends the call that Drain found finished.
  virtual void FinishNow() = 0;
};

/// The request path of every front end, with no transport in it: model or kept keys and values
/// resolved, the request validated against the model and limits, its bytes admitted against the
/// in-flight budget, submitted to the batcher, and completed with an answer or a status. Also the
/// in-flight accounting (metrics, bytes held, the drain). Front ends decode, call in here, and
/// encode what comes back. Thread-safe.
class RequestPipeline {
 public:
  /// Borrows everything; all must outlive the pipeline. Each request takes the repository's set of
  /// the moment it arrives, so a reload never changes a request already accepted.
  RequestPipeline(const ModelRepository& models, Batcher& batcher, ServerMetrics& metrics,
                  const AttendLimits& limits, const FlowLimits& flow, KvStore& kv);

  // ---- Calls: what every front end uses for a request (Attend, then Record once). ----
  /// Runs `x->request` and counts it in flight. `done` runs exactly once, on any thread (possibly
  /// before Attend returns), with what the client can be told: OK with `x->answer` filled, or the
  /// failure (also DEADLINE_EXCEEDED or CANCELLED when the answer came too late to be delivered; a
  /// session's step then is not applied). The caller then calls Record once the client's outcome
  /// is known; `x` must live until then.
  void Attend(const char* method, Exchange* x, CallContext call,
              std::function<void(const Status&)> done);
  /// Records an exchange's outcome as the client saw it (count, latency, in flight) and gives its
  /// bytes back. Once per exchange; later calls do nothing.
  void Record(const char* method, Exchange* x, const Status& seen);
  /// Counts a request that never reached Attend (it did not decode) as answered with `seen`.
  void RecordUndecoded(const char* method, const Status& seen);
  /// The trace a call with this context joins (empty with tracing off).
  CallTrace BeginTrace(const IncomingTrace& in) const;

  // ---- Kept keys and values: memories and sessions. ----
  /// Projects and keeps a memory; `done` runs once, on any thread, with `resp` filled when OK and
  /// the call's trace (for a failure to name).
  void CreateMemory(const v1::CreateMemoryRequest& req, CallContext call, v1::KvHandle* resp,
                    std::function<void(const Status&, const CallTrace&)> done);
  /// The other calls of kept keys and values answer at once; `traced`, when given, receives the
  /// call's trace (for a failure to name).
  /// Opens an empty decoding session.
  Status OpenSession(const v1::OpenSessionRequest& req, v1::KvHandle* resp,
                     const KvCaller& caller = {}, CallTrace* traced = nullptr);
  /// ForkSession: the new session, or the store's refusal.
  Status ForkSession(const v1::ForkSessionRequest& req, v1::KvHandle* resp,
                     const KvCaller& caller = {}, CallTrace* traced = nullptr);
  /// TruncateSession: the session after it, or the store's refusal.
  Status TruncateSession(const v1::TruncateSessionRequest& req, v1::KvHandle* resp,
                         const KvCaller& caller = {}, CallTrace* traced = nullptr);
  /// Ends a memory or a session (`method` is the metrics label).
  Status Release(const char* method, KvKind kind, const v1::ReleaseRequest& req,
                 v1::ReleaseResponse* resp, const KvCaller& caller = {},
                 CallTrace* traced = nullptr);

  // ---- Models: what is served, for the front ends' metadata calls and health. ----
  /// Every loaded version of every model.
  void ListModels(v1::ListModelsResponse* resp) const;
  /// One model version's description (version 0: the highest loaded).
  Status GetModel(const v1::GetModelRequest& req, v1::ModelInfo* resp) const;
  /// A loaded model version's spec and every loaded version of it (NOT_FOUND naming what is there).
  StatusOr<ModelSpec> Describe(const std::string& model, int64_t version,
                               std::vector<int64_t>* versions) const;
  /// Whether requests for `model` (version 0: the highest) would be served now: loaded, warm and
  /// not draining. An empty `model`: whether the server takes requests at all.
  bool Ready(const std::string& model, int64_t version) const;

  // ---- Open calls and the drain: streams register; the process drains at the stop. ----
  /// Registers an open call for the drain (a stream, from its start until it is done). A call that
  /// registers after the drain began is told by `draining()`.
  void AddCall(OpenCall* call);
  void RemoveCall(OpenCall* call);
  /// Starts the shutdown drain: every open call takes no new requests and finishes once its
  /// accepted requests are answered. Single requests are still served. Idempotent.
  void BeginDrain();
  /// Waits until no request is in flight, no call is open and none arrived for `quiet`, or until
  /// `deadline`; true when everything finished.
  bool WaitIdle(SteadyClock::time_point deadline, SteadyClock::duration quiet);
  bool draining() const { return draining_.load(); }
  const FlowLimits& flow() const { return flow_; }

  // ---- Set-up, before serving (the process), and what the front ends read of it. ----
  /// Where calls' spans and access-log lines go (both may be null: none). Set before serving;
  /// borrowed, and must outlive the pipeline's calls.
  void Observe(const Tracer* tracer, AccessLog* access_log);
  /// The address clients reach this replica at (--advertise-address; "" for none), returned in
  /// every KvHandle so clients route a memory's or session's calls to it. Set before serving.
  void SetAdvertisedAddress(std::string address);
  std::string advertised_address() const;
  /// While true, Ready says no: the models are warming up at start (requests are still served,
  /// only slower). False unless set.
  void SetWarming(bool warming) { warming_.store(warming); }
  /// The tenants' terms (--tenants; reread on a reload): each request takes those of the moment
  /// it arrives. Default: every tenant gets default terms.
  void SetTenants(std::shared_ptr<const Tenants> tenants);
  std::shared_ptr<const Tenants> tenants() const;
  /// The metadata key whose value names the tenant, trusted behind a gateway that sets it
  /// (--tenant-header; "": none, only certificates name tenants). Set before serving.
  void SetTenantHeader(std::string key) { tenant_header_ = std::move(key); }
  const std::string& tenant_header() const { return tenant_header_; }
  /// The pinned staging requests' tensors may be decoded into (a CUDA server's; null: none). Set
  /// before serving; borrowed.
  void SetStaging(HostStaging* staging) { staging_ = staging; }
  HostStaging* staging() const { return staging_; }

 private:
  // The steps of Attend; each returns the failure that ends the request there.
  Status Resolve(Exchange* x, WorkItem* item, std::shared_ptr<KvStep>* step);
  // Who asks and how urgently: the tenant's terms, the priority level and its queue timeout.
  Status Schedule(const Exchange& x, const TenantPolicy& terms, WorkItem* item) const;
  Status Admit(Exchange* x, const WorkItem& item);
  // The in-flight budget: Reserve takes `bytes` or refuses (RESOURCE_EXHAUSTED naming the flag);
  // Unreserve gives them back.
  Status Reserve(const std::string& model, int64_t bytes);
  void Unreserve(int64_t bytes);
  static int64_t HeldBytes(int64_t wire_bytes, DType wire, DType compute);
  // Metrics, span and access-log line for a call that is not an Attend; `handle`: the memory or
  // session it made or used; `traced`, when given, receives the call's trace.
  void RecordCall(const std::string& model, const char* method, const Status& st,
                  SteadyClock::time_point received, const IncomingTrace& trace = {},
                  const std::string& handle = "", CallTrace* traced = nullptr);
  // An Attend's spans (the call's, decode, queue, compute, encode) and access-log line.
  void Observed(const char* method, const Exchange& x, const Status& seen) const;
  void LogAccess(const char* method, const std::string& model, const CallTrace& trace,
                 const Status& seen, SteadyClock::time_point received, const Exchange* x) const;

  const ModelRepository& models_;
  Batcher& batcher_;
  ServerMetrics& metrics_;
  const AttendLimits limits_;
  const FlowLimits flow_;
  KvStore& kv_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> warming_{false};
  HostStaging* staging_ = nullptr;
  std::string tenant_header_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  int64_t held_bytes_ = 0;                // Σ Exchange::held_bytes of requests not yet recorded.
  int64_t in_flight_ = 0;                 // Accepted by Attend and not yet recorded.
  SteadyClock::time_point last_arrival_;  // Latest request or open call received.
  std::set<OpenCall*> calls_;
  std::string advertised_;
  const Tracer* tracer_ = nullptr;
  AccessLog* access_log_ = nullptr;
  std::shared_ptr<const Tenants> tenants_ = std::make_shared<Tenants>();  // Under mu_.
};

}  // namespace attnserve
