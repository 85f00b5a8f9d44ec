#pragma once

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <vector>

#include "server/grpc/send_watch.h"
#include "server/http/http_server.h"

namespace attnserve {

/// The connection guard's counts as Prometheus series, read at each scrape (docs/metrics.md
/// "Transport"): attnserve_connections, attnserve_transport_streams,
/// attnserve_transport_upload_bytes, attnserve_connections_refused_total{reason} and
/// attnserve_connections_closed_total{reason}; and the calls the send timeout cancelled,
/// attnserve_send_timeouts_total. Thread-safe.
class TransportMetrics final : public prometheus::Collectable {
 public:
  /// Borrows `sends`, which must outlive the metrics listener.
  explicit TransportMetrics(const SendWatch* sends) : sends_(sends) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const SendWatch* sends_;
};

/// The HTTP port's own series (docs/metrics.md "Transport"): attnserve_http_connections and
/// attnserve_http_body_bytes (the room of request bodies being received, bounded by
/// --max-inflight-bytes). Thread-safe.
class HttpMetrics final : public prometheus::Collectable {
 public:
  /// Borrows `http`, which must outlive the metrics listener.
  explicit HttpMetrics(const HttpServer* http) : http_(http) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const HttpServer* http_;
};

}  // namespace attnserve
