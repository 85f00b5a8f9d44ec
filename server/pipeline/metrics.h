#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"
#include "server/pipeline/batcher.h"

namespace attnserve {

/// The server's Prometheus metrics (docs/metrics.md "Metrics"). Registers its families once in the
/// registry it is given. Thread-safe.
class ServerMetrics {
 public:
  explicit ServerMetrics(prometheus::Registry& registry);

  /// One finished RPC (or one request inside AttendStream): count and latency, success or not.
  /// `model` is "" when the request named no loaded model.
  void RecordRequest(const std::string& model, const std::string& method, const std::string& code,
                     double seconds);
  /// Requests accepted and not yet answered, by method.
  void AddInFlight(const std::string& method, double delta);
  /// The bytes held against --max-inflight-bytes now (requests admitted, and answers until the
  /// transport has sent them).
  void SetInflightBytes(int64_t bytes);
  /// One computed batch: its size in requests and tokens, compute time and FLOPs, and each
  /// request's queue wait. (No padding metric: the engine packs rows and never pads.)
  void RecordBatch(const std::string& model, const std::vector<WorkItem*>& batch, double seconds);
  /// One request's host stages: decoding it off the wire (received to admitted) and encoding its
  /// answer (answered to recorded); a stage < 0 is not observed.
  void RecordRequestStages(double decode, double encode);
  /// Allocated and reserved bytes of a CUDA device's caching allocator.
  void SetDeviceMemory(const std::string& device, int64_t allocated, int64_t reserved);
  /// The CPU device's memory: the process's resident set (device "cpu", kind "resident").
  void SetHostMemory(int64_t resident);
  /// Shared memory registered by clients: bytes and regions.
  void SetSharedMemory(int64_t bytes, int64_t regions);
  /// The pinned staging's held bytes and budget (CUDA), and `refused` more blocks it refused.
  void SetStaging(int64_t held, int64_t budget, int64_t refused);
  /// A request refused or dropped before compute; reason: queue_full, draining, deadline,
  /// cancelled.
  void RecordRejection(const std::string& model, const char* reason);
  /// A batched step answered OK: its entries, one status each (attnserve_step_entries and
  /// attnserve_step_entries_total by code).
  void RecordSteps(const std::string& model, const std::vector<Status>& entries);
  /// Per tenant (its Tenants::Label): attnserve_tenant_requests_total{tenant, code}.
  void RecordTenantRequest(const std::string& tenant, const std::string& code);
  /// attnserve_tenant_rejections_total{tenant, reason}.
  void RecordTenantRejection(const std::string& tenant, const char* reason);
  /// attnserve_tenant_kv_bytes{tenant}: memories and sessions it holds.
  void SetTenantKvBytes(const std::string& tenant, int64_t bytes);
  /// Sets attnserve_model_info{...} 1 for a loaded model version (replacing that version's series).
  void AddModelInfo(const ModelSpec& spec);
  /// attnserve_cpu_info{cpu_class, onednn, blas} 1: the CPU's class and the libraries' kernels.
  void SetCpuInfo(const std::string& cpu_class, const std::string& onednn, const std::string& blas);
  /// Removes an unloaded model version's attnserve_model_info series.
  void RemoveModelInfo(const ModelSpec& spec);
  /// One reload: attnserve_model_reloads_total{outcome="ok"|"failed"}, and for each model with a
  /// version that failed to load, attnserve_model_load_failures_total{model}.
  void RecordReload(bool failed, const std::vector<std::string>& failed_models);
  /// attnserve_model_load_failing{model}: 1 for each model whose latest load failed, 0 for those
  /// that failed before and load now.
  void SetModelsFailing(const std::vector<std::string>& failing);
  /// attnserve_kv_bytes and attnserve_kv_entries{kind}.
  void SetKvSize(int64_t bytes, int64_t memories, int64_t sessions);
  /// attnserve_kv_model_entries{model, version, weights_hash}: memories and sessions on these
  /// weights (a version a reload replaced stays loaded for them); the series goes at 0.
  void SetKvModelEntries(const ModelSpec& spec, int64_t entries);
  /// attnserve_kv_lookups_total{kind, result="hit"|"miss"}.
  void RecordKvLookup(const char* kind, bool hit);
  /// attnserve_kv_ends_total{kind, reason} (KvEndReasonName).
  void RecordKvEnd(const char* kind, const char* reason);
  /// attnserve_trace_spans_exported_total: spans a collector accepted.
  void RecordSpansExported(int64_t spans);
  /// attnserve_trace_spans_dropped_total{reason="queue_full"|"export_failed"|"rejected"}.
  void RecordSpansDropped(int64_t spans, const char* reason);
  /// attnserve_access_log_dropped_total: access-log lines dropped with the log's queue full.
  void RecordAccessLogDropped();

 private:
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Gauge>& in_flight_;
  prometheus::Gauge& inflight_bytes_;
  prometheus::Family<prometheus::Histogram>& queue_;
  prometheus::Family<prometheus::Histogram>& compute_;
  prometheus::Family<prometheus::Histogram>& batch_size_;
  prometheus::Family<prometheus::Histogram>& batch_tokens_;
  prometheus::Family<prometheus::Histogram>& stage_;
  prometheus::Family<prometheus::Counter>& rejections_;
  prometheus::Family<prometheus::Counter>& backend_;
  prometheus::Family<prometheus::Counter>& flops_;
  prometheus::Family<prometheus::Gauge>& flops_rate_;
  prometheus::Family<prometheus::Gauge>& device_memory_;
  // Host memory that tensors pass through: a GPU's pinned staging, clients' shared memory.
  struct HostTransfer {
    prometheus::Family<prometheus::Gauge>& staging;
    prometheus::Family<prometheus::Counter>& staging_refused;
    prometheus::Family<prometheus::Gauge>& shared_memory;
  };
  static HostTransfer MakeHostTransfer(prometheus::Registry& registry);
  HostTransfer transfer_;
  // Per tenant: served FLOPs, queue wait, requests by outcome, rejections, kept bytes.
  struct TenantFamilies {
    prometheus::Family<prometheus::Counter>& flops;
    prometheus::Family<prometheus::Histogram>& queue;
    prometheus::Family<prometheus::Counter>& requests;
    prometheus::Family<prometheus::Counter>& rejections;
    prometheus::Family<prometheus::Gauge>& kv_bytes;
  };
  static TenantFamilies MakeTenantFamilies(prometheus::Registry& registry);
  TenantFamilies tenant_;
  // Batched steps: entries per call, and entries by their own code.
  struct StepFamilies {
    prometheus::Family<prometheus::Histogram>& entries;
    prometheus::Family<prometheus::Counter>& outcomes;
  };
  static StepFamilies MakeStepFamilies(prometheus::Registry& registry);
  // Series made at start with no events yet, so rate() and increase() see their first.
  void SeriesFromTheStart();
  StepFamilies steps_;
  prometheus::Family<prometheus::Gauge>& model_info_;
  prometheus::Family<prometheus::Gauge>& cpu_info_;
  prometheus::Family<prometheus::Counter>& reloads_;
  prometheus::Family<prometheus::Counter>& load_failures_;
  prometheus::Family<prometheus::Gauge>& load_failing_;
  prometheus::Gauge& kv_bytes_;
  prometheus::Family<prometheus::Gauge>& kv_entries_;
  prometheus::Family<prometheus::Gauge>& kv_model_entries_;
  prometheus::Family<prometheus::Counter>& kv_lookups_;
  prometheus::Family<prometheus::Counter>& kv_ends_;
  prometheus::Counter& spans_exported_;
  prometheus::Family<prometheus::Counter>& spans_dropped_;
  prometheus::Counter& access_log_dropped_;
  std::mutex info_mu_;
  std::map<std::pair<std::string, int64_t>, prometheus::Gauge*> info_;  // (model, version)
  std::map<std::string, prometheus::Gauge*> failing_;  // attnserve_model_load_failing by model
};

}  // namespace attnserve
