#include "server/pipeline/metrics.h"

namespace attnserve {
namespace {

// Bounds from `first`, doubling while below `below`.
const prometheus::Histogram::BucketBoundaries* Doubling(double first, double below) {
  auto* b = new prometheus::Histogram::BucketBoundaries;
  for (double v = first; v < below; v *= 2) b->push_back(v);
  return b;
}

// 100 µs to ~26 s: spans a tiny CPU forward up to a long queue wait.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* kBuckets = Doubling(1e-4, 30);
  return *kBuckets;
}

// 10 µs to ~10 s: a stage of a batch or request (a small copy takes microseconds).
const prometheus::Histogram::BucketBoundaries& StageBuckets() {
  static const auto* kBuckets = Doubling(1e-5, 12);
  return *kBuckets;
}

const prometheus::Histogram::BucketBoundaries& BatchBuckets() {
  static const auto* kBuckets =
      new prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128};
  return *kBuckets;
}

const prometheus::Histogram::BucketBoundaries& TokenBuckets() {
  static const auto* kBuckets = new prometheus::Histogram::BucketBoundaries{
      16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
  return *kBuckets;
}

// A metric family of each kind, registered.
prometheus::Family<prometheus::Histogram>& Histogram(prometheus::Registry& r, const char* name,
                                                     const char* help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Counter>& Counter(prometheus::Registry& r, const char* name,
                                                 const char* help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Gauge>& Gauge(prometheus::Registry& r, const char* name,
                                             const char* help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}

}  // namespace

ServerMetrics::HostTransfer ServerMetrics::MakeHostTransfer(prometheus::Registry& registry) {
  return {
      Gauge(registry, "attnserve_staging_bytes",
            "Pinned host memory for copies to and from the GPU (--staging-bytes): kind held (in "
            "blocks alive now: batches copying, answers being sent) and budget."),
      Counter(registry, "attnserve_staging_refused_total",
              "Staging blocks refused because the budget was full: that batch's copies went "
              "through pageable memory (slower)."),
      Gauge(registry, "attnserve_shared_memory",
            "Shared memory clients registered (--allow-shared-memory): kind bytes and regions. "
            "Read through descriptors, never mapped into the server.")};
}

ServerMetrics::TenantFamilies ServerMetrics::MakeTenantFamilies(prometheus::Registry& registry) {
  return {Counter(registry, "attnserve_tenant_flops_total",
                  "Floating-point operations computed for a tenant (what its fair share counts)."),
          Histogram(registry, "attnserve_tenant_queue_wait_seconds",
                    "Time a tenant's request waited between acceptance and the start of compute."),
          Counter(registry, "attnserve_tenant_requests_total",
                  "A tenant's requests answered, by gRPC status code."),
          Counter(registry, "attnserve_tenant_rejections_total",
                  "A tenant's requests refused or dropped before compute, by reason."),
          Gauge(registry, "attnserve_tenant_kv_bytes",
                "Bytes of memories and sessions a tenant holds (counted against its K/V share).")};
}

ServerMetrics::StepFamilies ServerMetrics::MakeStepFamilies(prometheus::Registry& registry) {
  return {Histogram(registry, "attnserve_step_entries",
                    "Entries (sessions or memories) of each batched step answered "
                    "(AttendRequest.steps)."),
          Counter(registry, "attnserve_step_entries_total",
                  "Entries of batched steps answered, by each entry's own gRPC status code (a "
                  "refused entry changed nothing).")};
}

ServerMetrics::ServerMetrics(prometheus::Registry& registry)
    : latency_(Histogram(registry, "attnserve_request_duration_seconds",
                         "Time from receiving a request to its answer, at the RPC boundary.")),
      requests_(Counter(registry, "attnserve_requests_total",
                        "Requests answered, by model, method and gRPC status code.")),
      in_flight_(Gauge(registry, "attnserve_requests_in_flight",
                       "Requests received and not yet answered.")),
      inflight_bytes_(Gauge(registry, "attnserve_inflight_bytes",
                            "Bytes held against --max-inflight-bytes (answers: until sent).")
                          .Add({})),
      queue_(Histogram(registry, "attnserve_queue_wait_seconds",
                       "Time a request waited between acceptance and the start of compute.")),
      compute_(Histogram(registry, "attnserve_compute_seconds", "Engine time of one batch.")),
      batch_size_(Histogram(registry, "attnserve_batch_size_requests",
                            "Requests computed together in one engine call.")),
      batch_tokens_(Histogram(registry, "attnserve_batch_size_tokens",
                              "Query plus key tokens computed together in one engine call.")),
      stage_(Histogram(registry, "attnserve_stage_seconds",
                       "Where the time goes, by stage: per request decode (off the wire, to "
                       "admission) and encode (the answer onto the wire); per batch on a GPU "
                       "gather (into pinned staging, host), copy_in, compute, copy_out (CUDA "
                       "events).")),
      rejections_(Counter(registry, "attnserve_rejections_total",
                          "Requests refused or dropped before compute, by reason.")),

      backend_(Counter(registry, "attnserve_attention_backend_total",
                       "Computed requests by the attention kernel that ran (math, flash, "
                       "efficient, cudnn).")),
      flops_(Counter(registry, "attnserve_flops_total",
                     "Floating-point operations computed (projections, QK^T, PV).")),
      flops_rate_(Gauge(registry, "attnserve_achieved_flops_per_second",
                        "FLOP/s achieved by the last batch: its FLOPs over its compute time.")),
      device_memory_(
          Gauge(registry, "attnserve_device_memory_bytes",
                "Device memory by kind: on CUDA the caching allocator's allocated and reserved "
                "bytes; on the CPU the process's resident set (kind resident).")),
      transfer_(MakeHostTransfer(registry)),
      tenant_(MakeTenantFamilies(registry)),
      steps_(MakeStepFamilies(registry)),
      model_info_(Gauge(registry, "attnserve_model_info",
                        "A loaded model version (value 1), described by its labels.")),
      cpu_info_(
          Gauge(registry, "attnserve_cpu_info",
                "The CPU's class for bfloat16 products (AMX, AVX512-BF16, AVX-512 "
                "without BF16, AVX2 only), oneDNN's version and ISA, and the BLAS (value 1).")),
      reloads_(Counter(registry, "attnserve_model_reloads_total",
                       "Model repository reloads (SIGHUP or AdminService.ReloadModels), by "
                       "outcome: ok, or failed (a version did not load, or the repository could "
                       "not be read; what served before still serves).")),
      load_failures_(Counter(registry, "attnserve_model_load_failures_total",
                             "Reloads in which a version of this model failed to load.")),
      load_failing_(Gauge(registry, "attnserve_model_load_failing",
                          "1 while the latest load of a version of this model failed (what "
                          "served before still serves); 0 once it loads or its directory goes.")),
      kv_bytes_(Gauge(registry, "attnserve_kv_bytes",
                      "Device bytes held by memories and decoding sessions (ended ones still "
                      "in use included).")
                    .Add({})),
      kv_entries_(
          Gauge(registry, "attnserve_kv_entries", "Memories and decoding sessions held, by kind.")),
      kv_model_entries_(Gauge(registry, "attnserve_kv_model_entries",
                              "Memories and decoding sessions on one model version's weights "
                              "(they keep the weights they were made with across reloads).")),
      kv_lookups_(Counter(registry, "attnserve_kv_lookups_total",
                          "Requests naming a memory or session, by kind and result (hit, miss).")),
      kv_ends_(Counter(registry, "attnserve_kv_ends_total",
                       "Memories and sessions ended, by kind and reason (released, evicted, "
                       "expired, unloaded, failed, shutdown).")),
      spans_exported_(Counter(registry, "attnserve_trace_spans_exported_total",
                              "Trace spans the OTLP collector accepted (docs/tracing.md).")
                          .Add({})),
      spans_dropped_(Counter(registry, "attnserve_trace_spans_dropped_total",
                             "Trace spans dropped, by reason: queue_full (the exporter's queue was "
                             "full), export_failed (the collector was down, slow or refused), "
                             "rejected (the collector said so).")),
      access_log_dropped_(Counter(registry, "attnserve_access_log_dropped_total",
                                  "Access-log lines dropped because the log's queue was full.")
                              .Add({})) {
  SeriesFromTheStart();
}

void ServerMetrics::SeriesFromTheStart() {
  for (const char* reason : {"queue_full", "export_failed", "rejected"}) {
    spans_dropped_.Add({{"reason", reason}});
  }
  // Both outcomes exist from the start, so rate() and increase() see the first reload.
  reloads_.Add({{"outcome", "ok"}});
  reloads_.Add({{"outcome", "failed"}});
}

void ServerMetrics::RecordRequest(const std::string& model, const std::string& method,
                                  const std::string& code, double seconds) {
  const prometheus::Labels labels{{"model", model}, {"method", method}, {"code", code}};
  latency_.Add(labels, LatencyBuckets()).Observe(seconds);
  requests_.Add(labels).Increment();
}

void ServerMetrics::AddInFlight(const std::string& method, double delta) {
  in_flight_.Add({{"method", method}}).Increment(delta);
}

void ServerMetrics::SetInflightBytes(int64_t bytes) {
  inflight_bytes_.Set(static_cast<double>(bytes));
}

void ServerMetrics::RecordBatch(const std::string& model, const std::vector<WorkItem*>& batch,
                                double seconds) {
  const prometheus::Labels labels{{"model", model}};
  auto& queue = queue_.Add(labels, LatencyBuckets());
  int64_t tokens = 0;
  double flops = 0;
  for (const WorkItem* item : batch) {
    queue.Observe(item->queue_seconds);
    const prometheus::Labels tenant{{"tenant", item->tenant_label}};
    tenant_.queue.Add(tenant, LatencyBuckets()).Observe(item->queue_seconds);
    tenant_.flops.Add(tenant).Increment(item->flops);
    tokens += item->tokens();
    // A batched step's entries, each counted as its own call would be.
    if (item->entries.empty()) {
      flops += ForwardFlops(item->model->spec(), item->call);
      backend_.Add({{"model", model}, {"backend", item->outputs.attention_backend}}).Increment();
    }
    for (const WorkItem::Entry& entry : item->entries) {
      flops += ForwardFlops(item->model->spec(), entry.call);
      backend_.Add({{"model", model}, {"backend", entry.outputs.attention_backend}}).Increment();
    }
  }
  flops_.Add(labels).Increment(flops);
  if (seconds > 0) flops_rate_.Add(labels).Set(flops / seconds);
  compute_.Add(labels, LatencyBuckets()).Observe(seconds);
  batch_size_.Add(labels, BatchBuckets()).Observe(static_cast<double>(batch.size()));
  batch_tokens_.Add(labels, TokenBuckets()).Observe(static_cast<double>(tokens));
  if (batch.empty()) return;
  const BatchStages& stages = batch.front()->outputs.stages;
  for (const auto& [stage, value] : {std::pair{"gather", stages.gather},
                                     {"copy_in", stages.copy_in},
                                     {"compute", stages.compute},
                                     {"copy_out", stages.copy_out}}) {
    if (value >= 0) stage_.Add({{"stage", stage}}, StageBuckets()).Observe(value);
  }
}

void ServerMetrics::RecordRequestStages(double decode, double encode) {
  if (decode >= 0) stage_.Add({{"stage", "decode"}}, StageBuckets()).Observe(decode);
  if (encode >= 0) stage_.Add({{"stage", "encode"}}, StageBuckets()).Observe(encode);
}

void ServerMetrics::SetDeviceMemory(const std::string& device, int64_t allocated,
                                    int64_t reserved) {
  device_memory_.Add({{"device", device}, {"kind", "allocated"}})
      .Set(static_cast<double>(allocated));
  device_memory_.Add({{"device", device}, {"kind", "reserved"}}).Set(static_cast<double>(reserved));
}

void ServerMetrics::SetHostMemory(int64_t resident) {
  device_memory_.Add({{"device", "cpu"}, {"kind", "resident"}}).Set(static_cast<double>(resident));
}

void ServerMetrics::SetSharedMemory(int64_t bytes, int64_t regions) {
  transfer_.shared_memory.Add({{"kind", "bytes"}}).Set(static_cast<double>(bytes));
  transfer_.shared_memory.Add({{"kind", "regions"}}).Set(static_cast<double>(regions));
}

void ServerMetrics::SetStaging(int64_t held, int64_t budget, int64_t refused) {
  transfer_.staging.Add({{"kind", "held"}}).Set(static_cast<double>(held));
  transfer_.staging.Add({{"kind", "budget"}}).Set(static_cast<double>(budget));
  if (refused > 0) transfer_.staging_refused.Add({}).Increment(static_cast<double>(refused));
}

void ServerMetrics::RecordRejection(const std::string& model, const char* reason) {
  rejections_.Add({{"model", model}, {"reason", reason}}).Increment();
}

void ServerMetrics::RecordSteps(const std::string& model, const std::vector<Status>& entries) {
  static const auto* kBuckets =
      new prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  steps_.entries.Add({{"model", model}}, *kBuckets).Observe(static_cast<double>(entries.size()));
  for (const Status& st : entries)
    steps_.outcomes.Add({{"model", model}, {"code", StatusCodeName(st.code())}}).Increment();
}

void ServerMetrics::RecordTenantRequest(const std::string& tenant, const std::string& code) {
  tenant_.requests.Add({{"tenant", tenant}, {"code", code}}).Increment();
}

void ServerMetrics::RecordTenantRejection(const std::string& tenant, const char* reason) {
  tenant_.rejections.Add({{"tenant", tenant}, {"reason", reason}}).Increment();
}

void ServerMetrics::SetTenantKvBytes(const std::string& tenant, int64_t bytes) {
  tenant_.kv_bytes.Add({{"tenant", tenant}}).Set(static_cast<double>(bytes));
}

void ServerMetrics::AddModelInfo(const ModelSpec& s) {
  RemoveModelInfo(s);
  std::lock_guard<std::mutex> lock(info_mu_);
  info_[{s.name, s.version}] = &model_info_.Add({{"model", s.name},
                                                 {"version", std::to_string(s.version)},
                                                 {"embed_dim", std::to_string(s.embed_dim)},
                                                 {"num_heads", std::to_string(s.num_heads)},
                                                 {"kdim", std::to_string(s.kdim)},
                                                 {"vdim", std::to_string(s.vdim)},
                                                 {"device", s.device},
                                                 {"compute_dtype", DTypeName(s.compute_dtype)},
                                                 {"kernels", s.kernels},
                                                 {"weights_hash", s.weights_hash}});
  info_[{s.name, s.version}]->Set(1);
}

void ServerMetrics::SetCpuInfo(const std::string& cpu_class, const std::string& onednn,
                               const std::string& blas) {
  cpu_info_.Add({{"cpu_class", cpu_class}, {"onednn", onednn}, {"blas", blas}}).Set(1);
}

void ServerMetrics::RemoveModelInfo(const ModelSpec& s) {
  std::lock_guard<std::mutex> lock(info_mu_);
  auto it = info_.find({s.name, s.version});
  if (it == info_.end()) return;
  model_info_.Remove(it->second);
  info_.erase(it);
}

void ServerMetrics::SetModelsFailing(const std::vector<std::string>& failing) {
  std::lock_guard<std::mutex> lock(info_mu_);
  for (auto& [model, gauge] : failing_) gauge->Set(0);
  for (const std::string& model : failing) {
    auto it = failing_.find(model);
    if (it == failing_.end())
      it = failing_.emplace(model, &load_failing_.Add({{"model", model}})).first;
    it->second->Set(1);
  }
}

void ServerMetrics::RecordReload(bool failed, const std::vector<std::string>& failed_models) {
  reloads_.Add({{"outcome", failed ? "failed" : "ok"}}).Increment();
  for (const std::string& model : failed_models) load_failures_.Add({{"model", model}}).Increment();
}

void ServerMetrics::SetKvSize(int64_t bytes, int64_t memories, int64_t sessions) {
  kv_bytes_.Set(static_cast<double>(bytes));
  kv_entries_.Add({{"kind", "memory"}}).Set(static_cast<double>(memories));
  kv_entries_.Add({{"kind", "session"}}).Set(static_cast<double>(sessions));
}

void ServerMetrics::SetKvModelEntries(const ModelSpec& s, int64_t entries) {
  const std::map<std::string, std::string> labels = {
      {"model", s.name}, {"version", std::to_string(s.version)}, {"weights_hash", s.weights_hash}};
  prometheus::Gauge& gauge = kv_model_entries_.Add(labels);
  if (entries > 0) {
    gauge.Set(static_cast<double>(entries));
  } else {
    kv_model_entries_.Remove(&gauge);
  }
}

void ServerMetrics::RecordKvLookup(const char* kind, bool hit) {
  kv_lookups_.Add({{"kind", kind}, {"result", hit ? "hit" : "miss"}}).Increment();
}

void ServerMetrics::RecordKvEnd(const char* kind, const char* reason) {
  kv_ends_.Add({{"kind", kind}, {"reason", reason}}).Increment();
}

void ServerMetrics::RecordSpansExported(int64_t spans) {
  spans_exported_.Increment(static_cast<double>(spans));
}

void ServerMetrics::RecordSpansDropped(int64_t spans, const char* reason) {
  spans_dropped_.Add({{"reason", reason}}).Increment(static_cast<double>(spans));
}

void ServerMetrics::RecordAccessLogDropped() { access_log_dropped_.Increment(); }

}  // namespace attnserve
