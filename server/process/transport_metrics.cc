#include "server/process/transport_metrics.h"

#include <map>
#include <string>

#include "server/process/connection_guard.h"

namespace attnserve {
namespace {

// A series of one value, unlabelled.
prometheus::MetricFamily One(prometheus::MetricType type, const char* name, const char* help,
                             double value) {
  prometheus::MetricFamily f{name, help, type, {}};
  prometheus::ClientMetric m;
  (type == prometheus::MetricType::Gauge ? m.gauge.value : m.counter.value) = value;
  f.metric.push_back(m);
  return f;
}

// A counter by reason, every reason listed (0 until it happens), so a dashboard's series exist.
prometheus::MetricFamily ByReason(const char* name, const char* help,
                                  const std::vector<const char*>& reasons,
                                  std::map<std::string, int64_t> counts) {
  prometheus::MetricFamily f{name, help, prometheus::MetricType::Counter, {}};
  for (const char* reason : reasons) counts.emplace(reason, 0);
  for (const auto& [reason, n] : counts) {
    prometheus::ClientMetric m;
    m.label.push_back({"reason", reason});
    m.counter.value = static_cast<double>(n);
    f.metric.push_back(m);
  }
  return f;
}

}  // namespace

std::vector<prometheus::MetricFamily> TransportMetrics::Collect() const {
  const GuardCounts c = ConnectionGuard::Get().counts();
  return {
      One(prometheus::MetricType::Gauge, "attnserve_connections",
          "Client connections open on the gRPC listeners", static_cast<double>(c.connections)),
      One(prometheus::MetricType::Gauge, "attnserve_transport_streams",
          "HTTP/2 streams open on plaintext connections", static_cast<double>(c.streams)),
      One(prometheus::MetricType::Gauge, "attnserve_transport_upload_bytes",
          "Bytes of request messages not yet whole on plaintext connections",
          static_cast<double>(c.partial_bytes)),
      ByReason("attnserve_connections_refused_total",
               "Connections closed as they were accepted, by the bound they met",
               {"max_connections", "peer_connections", "fd_limit"}, c.refused),
      ByReason(
          "attnserve_connections_closed_total",
          "Connections closed for what their client sent, by the bound it broke",
          {"streams", "peer_streams", "listener_streams", "peer_uploads", "uploads", "header_bytes",
           "header_frames", "header_timeout", "message_bytes", "resets", "settings",
           "max_connections_pushed_out", "listener_streams_pushed_out", "uploads_pushed_out"},
          c.closed),
      One(prometheus::MetricType::Counter, "attnserve_send_timeouts_total",
          "Calls cancelled because their caller did not take the answer within "
          "--send-timeout-seconds",
          static_cast<double>(sends_->cancelled())),
  };
}

std::vector<prometheus::MetricFamily> HttpMetrics::Collect() const {
  return {
      One(prometheus::MetricType::Gauge, "attnserve_http_connections",
          "Client connections open on the HTTP port", static_cast<double>(http_->connections())),
      One(prometheus::MetricType::Gauge, "attnserve_http_body_bytes",
          "Room taken by HTTP request bodies being received (bounded by --max-inflight-bytes)",
          static_cast<double>(http_->body_bytes())),
  };
}

}  // namespace attnserve
