#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/core/status.h"
#include "server/trace/span.h"

namespace attnserve {

/// Where and how spans are exported (server flags --trace-*; docs/tracing.md).
struct ExporterOptions {
  /// The OTLP/gRPC collector, host:port (--trace-endpoint; a host alone takes port 4317).
  std::string endpoint;
  /// TLS to the collector: a PEM CA bundle to verify it ("" with tls: the system's roots), and a
  /// client certificate and key for mutual TLS. tls false: plaintext.
  bool tls = false;
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  /// The resource every span belongs to: service.name, service.instance.id, service.version.
  std::vector<SpanAttribute> resource;
  /// Spans waiting for export; a span that finds it full is dropped (counted).
  size_t max_queue_spans = 4096;
  /// Spans per Export call.
  size_t max_batch_spans = 512;
  /// How long a span may wait for its batch to fill.
  std::chrono::milliseconds interval{500};
  /// One Export call's deadline: a stalled collector holds the exporter no longer.
  std::chrono::milliseconds timeout{2000};
  /// Counts (for metrics), called on the exporter's thread or, for a full queue, the caller's.
  std::function<void(int64_t spans)> on_exported;
  std::function<void(int64_t spans, const char* reason)> on_dropped;  // queue_full, export_failed

  /// FAILED_PRECONDITION naming the flag at fault.
  Status Validate() const;
};

/// A bounded queue of finished spans and one background thread that sends them in batches to an
/// OTLP collector over gRPC (opentelemetry.proto.collector.trace.v1.TraceService/Export). Export
/// never blocks: when the queue is full the span is dropped. A failed Export drops its batch; the
/// first failure and the recovery are said once each on stderr.
class OtlpExporter final : public SpanSink {
 public:
  /// Reads the TLS files; FAILED_PRECONDITION naming the flag when one cannot be read.
  static StatusOr<std::unique_ptr<OtlpExporter>> Start(ExporterOptions options);
  ~OtlpExporter() override;  ///< Shutdown(), then joins.

  void Export(SpanData span) override;
  /// Sends what is queued (one more try, within the export timeout) and stops the thread; spans
  /// exported later are dropped. Idempotent.
  void Shutdown();

  const std::string& endpoint() const { return options_.endpoint; }
  int64_t exported() const { return exported_.load(); }
  int64_t dropped() const { return dropped_.load(); }

 private:
  OtlpExporter(ExporterOptions options, std::shared_ptr<grpc::Channel> channel);
  void Loop();
  bool Send(std::vector<SpanData> batch);
  void Dropped(int64_t n, const char* reason);

  const ExporterOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SpanData> queue_;
  bool stopping_ = false;
  bool failing_ = false;  // The last Export failed (said once, until one succeeds).
  std::atomic<int64_t> exported_{0}, dropped_{0};
  std::thread thread_;
};

}  // namespace attnserve
