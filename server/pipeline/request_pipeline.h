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
#include "server/pipeline/calls.h"
#include "server/pipeline/kept_kv.h"
#include "server/pipeline/metrics.h"
#include "server/pipeline/served_models.h"
#include "server/tenants/tenants.h"
#include "server/trace/access_log.h"
#include "server/trace/tracer.h"

namespace attnserve {

/// The request path of every front end, with no transport in it: model or kept keys and values
/// resolved, the request validated against the model and limits, its bytes admitted against the
/// in-flight budget, submitted to the batcher, and completed with an answer or a status. Also the
/// in-flight accounting (metrics, bytes held, the drain). Front ends decode, call in here, and
/// encode what comes back. Each sees it through the concerns it uses: requests (CallPath, in
/// calls.h), kept keys and values (KeptKv), the models served (ServedModels); the process sets it
/// up and drains it through the rest. Thread-safe.
class RequestPipeline final : public CallPath, public KeptKv, public ServedModels {
 public:
  /// Borrows everything; all must outlive the pipeline. Each request takes the repository's set of
  /// the moment it arrives, so a reload never changes a request already accepted.
  RequestPipeline(const ModelRepository& models, Batcher& batcher, ServerMetrics& metrics,
                  const AttendLimits& limits, const FlowLimits& flow, KvStore& kv);

  // ---- CallPath: what every front end uses for a request (calls.h says what each does). ----
  void Attend(const char* method, std::unique_ptr<Exchange> x, CallContext call,
              std::function<void(Answered)> done) override;
  void RecordUndecoded(const char* method, const Status& seen) override;
  void AddCall(OpenCall* call) override;
  void RemoveCall(OpenCall* call) override;
  bool draining() const override { return draining_.load(); }
  const FlowLimits& flow() const override { return flow_; }
  const std::string& tenant_header() const override { return tenant_header_; }
  HostStaging* staging() const override { return staging_; }

  // ---- KeptKv: memories and sessions (kept_kv.h). ----
  void CreateMemory(const v1::CreateMemoryRequest& req, CallContext call, v1::KvHandle* resp,
                    std::function<void(const Status&, const CallTrace&)> done) override;
  Status OpenSession(const v1::OpenSessionRequest& req, v1::KvHandle* resp, const KvCaller& caller,
                     CallTrace* traced) override;
  Status ForkSession(const v1::ForkSessionRequest& req, v1::KvHandle* resp, const KvCaller& caller,
                     CallTrace* traced) override;
  Status TruncateSession(const v1::TruncateSessionRequest& req, v1::KvHandle* resp,
                         const KvCaller& caller, CallTrace* traced) override;
  Status Release(const char* method, KvKind kind, const v1::ReleaseRequest& req,
                 v1::ReleaseResponse* resp, const KvCaller& caller, CallTrace* traced) override;

  // ---- ServedModels: what is served (served_models.h). ----
  void ListModels(v1::ListModelsResponse* resp) const override;
  Status GetModel(const v1::GetModelRequest& req, v1::ModelInfo* resp) const override;
  StatusOr<ModelSpec> Describe(const std::string& model, int64_t version,
                               std::vector<int64_t>* versions) const override;
  bool Ready(const std::string& model, int64_t version) const override;

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
  /// The tenant header (CallPath::tenant_header). Set before serving.
  void SetTenantHeader(std::string key) { tenant_header_ = std::move(key); }
  /// The pinned staging (CallPath::staging; null: none). Set before serving; borrowed.
  void SetStaging(HostStaging* staging) { staging_ = staging; }

 private:
  // Answered's: records the ending (count, latency, in flight) and gives the bytes back.
  void Record(const char* method, Exchange* x, const Status& seen) override;
  // The trace a call with this context joins (empty with tracing off).
  CallTrace BeginTrace(const IncomingTrace& in) const;
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
