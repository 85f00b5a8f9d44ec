#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "attnserve/v1/attention.pb.h"
#include "server/core/wire.h"
#include "server/kv/kv_store.h"
#include "server/models/model_repository.h"
#include "server/pipeline/batcher.h"
#include "server/pipeline/calls.h"
#include "server/pipeline/metrics.h"
#include "server/tenants/tenants.h"
#include "server/trace/access_log.h"
#include "server/trace/tracer.h"

namespace attnserve {

/// A batched step's sessions and memories while it is in flight (request_steps.cc): one of each
/// per entry of AttendRequest.steps, in order.
struct StepsHeld {
  std::vector<std::unique_ptr<KvStep>> kv;  ///< Its session's step; null: a memory, or refused.
  std::vector<int> computed;                ///< Its index in WorkItem::entries; -1: refused.
  std::vector<Status> refused;              ///< Why it was refused before compute.
  /// The entries' outcome: each step is applied when the call was delivered and its entry computed
  /// (`outcome`, per entry); every session is let go of.
  void End(bool delivered, const std::vector<Status>& outcome);
};

/// The request path of every front end, with no transport in it: model or kept keys and values
/// resolved, the request validated against the model and limits, its bytes admitted against the
/// in-flight budget, submitted to the batcher, and completed with an answer or a status. Also the
/// in-flight accounting (metrics, bytes held, the drain). Front ends decode, call in here, and
/// encode what comes back. Its public methods come in groups by concern: requests (every front
/// end), kept keys and values (the services that offer them), the models served (metadata and
/// readiness), the drain and the set-up (the process). No method is virtual (docs/layout.md says
/// why). Thread-safe.
class RequestPipeline {
 public:
  /// Borrows everything; all must outlive the pipeline. Each request takes the repository's set of
  /// the moment it arrives, so a reload never changes a request already accepted.
  RequestPipeline(const ModelRepository& models, Batcher& batcher, ServerMetrics& metrics,
                  const AttendLimits& limits, const FlowLimits& flow, KvStore& kv);

  // ---- Requests: what every front end uses (Attend; RecordUndecoded for one that never
  // decoded). ----
  /// Runs `x->request` and counts it in flight. `done` runs exactly once, on any thread (possibly
  /// before Attend returns), with the answered request; its handle records the ending.
  void Attend(const char* method, std::unique_ptr<Exchange> x, CallContext call,
              std::function<void(Answered)> done);
  /// Counts a request that never reached Attend (it did not decode) as answered with `seen`.
  void RecordUndecoded(const char* method, const Status& seen);
  /// Registers an open call for the drain (a stream, from its start until it is done). A call that
  /// registers after the drain began is told by `draining()`.
  void AddCall(OpenCall* call);
  void RemoveCall(OpenCall* call);
  bool draining() const { return draining_.load(); }
  const FlowLimits& flow() const { return flow_; }
  /// The metadata key whose value names the tenant, trusted behind a gateway that sets it
  /// (--tenant-header; "": none, only certificates name tenants).
  const std::string& tenant_header() const { return tenant_header_; }
  /// The pinned staging requests' tensors may be decoded into (a CUDA server's; null: none).
  HostStaging* staging() const { return staging_; }

  // ---- Kept keys and values: memories and sessions. `traced`, when not null, receives the
  // call's trace (for a failure to name). ----
  /// Projects and keeps a memory; `done` runs once, on any thread, with `resp` filled when OK and
  /// the call's trace.
  void CreateMemory(const v1::CreateMemoryRequest& req, CallContext call, v1::KvHandle* resp,
                    std::function<void(const Status&, const CallTrace&)> done);
  /// Opens an empty decoding session.
  Status OpenSession(const v1::OpenSessionRequest& req, v1::KvHandle* resp, const KvCaller& caller,
                     CallTrace* traced);
  /// ForkSession: the new session, or the store's refusal.
  Status ForkSession(const v1::ForkSessionRequest& req, v1::KvHandle* resp, const KvCaller& caller,
                     CallTrace* traced);
  /// TruncateSession: the session after it, or the store's refusal.
  Status TruncateSession(const v1::TruncateSessionRequest& req, v1::KvHandle* resp,
                         const KvCaller& caller, CallTrace* traced);
  /// Ends a memory or a session (`method` is the metrics label).
  Status Release(const char* method, KvKind kind, const v1::ReleaseRequest& req,
                 v1::ReleaseResponse* resp, const KvCaller& caller, CallTrace* traced);

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

  // ---- The drain: the process starts it at the stop and waits for the calls to end. ----
  /// Starts the shutdown drain: every open call takes no new requests and finishes once its
  /// accepted requests are answered. Single requests are still served. Idempotent.
  void BeginDrain();
  /// Waits until no request is in flight, no call is open and none arrived for `quiet`, or until
  /// `deadline`; true when everything finished.
  bool WaitIdle(SteadyClock::time_point deadline, SteadyClock::duration quiet);

  // ---- Set-up, before serving (the process). ----
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
  /// Whose fair share a request draws on and whose per-caller bounds it counts against: its tenant
  /// when it names one, else (`by_peer`, the default) "default@" and its peer's address, so that
  /// one address cannot fill the queue or the in-flight budget for all; else "default". Set
  /// before serving (--fair-by-peer).
  void SetCallerByPeer(bool by_peer) { caller_by_peer_ = by_peer; }
  std::string CallerOf(const CallContext& call) const;
  /// The tenant header (tenant_header()). Set before serving.
  void SetTenantHeader(std::string key) { tenant_header_ = std::move(key); }
  /// The pinned staging (staging(); null: none). Set before serving; borrowed.
  void SetStaging(HostStaging* staging) { staging_ = staging; }
  /// Once configured (the Set calls above), before the first call: every call's context (CallOf)
  /// reads Published() first. gRPC orders the two, but inside its uninstrumented library, where
  /// ThreadSanitizer cannot see it (a handler's read of the tenant header against Start's write,
  /// on a gRPC thread an earlier server had started); this release and acquire show it.
  void Publish() { published_.store(true, std::memory_order_release); }
  bool Published() const { return published_.load(std::memory_order_acquire); }

 private:
  friend class Answered;
  friend class HeldBytes;
  // Answered's: records the ending (count, latency, in flight) and gives the bytes back.
  void Record(const char* method, Exchange* x, const Status& seen);
  // The trace a call with this context joins (empty with tracing off).
  CallTrace BeginTrace(const IncomingTrace& in) const;
  // The steps of Attend; each returns the failure that ends the request there.
  Status Resolve(Exchange* x, WorkItem* item, std::shared_ptr<KvStep>* step);
  // Resolve for a batched step: the entries' handles begun or looked up, validated and reserved,
  // those that pass in `item->entries`; a refused entry's status in `held`. The call fails only
  // for what is the call's (its own fields, --max-steps-per-call, --max-request-tokens in all).
  Status ResolveSteps(Exchange* x, WorkItem* item, StepsHeld* held);
  // A batched step's answer: the meta of every entry, its status and output bytes (`w`: the
  // computed item; null when no entry reached compute).
  // Sends a resolved batched step to the batcher (or answers it at once when no entry passed);
  // `finish` runs once with the call's outcome.
  void SubmitSteps(Exchange* x, std::unique_ptr<WorkItem> item, std::shared_ptr<StepsHeld> held,
                   uint32_t previous_attempts, std::function<void(const Status&)> finish);
  // What a computed item tells its exchange: its batch's times, and the staging given back.
  static void Computed(Exchange* x, const WorkItem& w);
  static void AnswerSteps(Exchange* x, const StepsHeld& held, const WorkItem* w,
                          uint32_t previous_attempts);
  // Who asks and how urgently: the tenant's terms, the priority level and its queue timeout.
  Status Schedule(const Exchange& x, const TenantPolicy& terms, WorkItem* item) const;
  Status Admit(Exchange* x, const WorkItem& item);
  // The in-flight budget, the whole and each caller's: Reserve takes `bytes` for `caller` or
  // refuses (RESOURCE_EXHAUSTED naming the flag); Unreserve gives them back.
  Status Reserve(const std::string& model, int64_t bytes, const std::string& caller);
  void Unreserve(int64_t bytes, const std::string& caller);
  void UnreserveLocked(int64_t bytes, const std::string& caller);  // Under mu_.
  static int64_t WidenedBytes(int64_t wire_bytes, DType wire, DType compute);
  // What one entry of a batched step holds while in flight beyond its tensors (its call, status,
  // answer fields; measured ~1.8 KiB), counted in the in-flight bytes.
  static constexpr int64_t kStepBookkeepingBytes = 2048;
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
  std::atomic<bool> published_{false};
  HostStaging* staging_ = nullptr;
  std::string tenant_header_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  int64_t held_bytes_ = 0;  // Σ Exchange::held_bytes of requests not yet recorded, and HeldBytes.
  std::unordered_map<std::string, int64_t> held_by_caller_;  // The same by Exchange::caller.
  bool caller_by_peer_ = true;
  int64_t in_flight_ = 0;                 // Accepted by Attend and not yet recorded.
  SteadyClock::time_point last_arrival_;  // Latest request or open call received.
  std::set<OpenCall*> calls_;
  std::string advertised_;
  const Tracer* tracer_ = nullptr;
  AccessLog* access_log_ = nullptr;
  std::shared_ptr<const Tenants> tenants_ = std::make_shared<Tenants>();  // Under mu_.
};

}  // namespace attnserve
