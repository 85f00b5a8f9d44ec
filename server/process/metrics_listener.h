#pragma once

#include <memory>
#include <string>

#include "server/core/status.h"

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace attnserve {

/// The HTTP listener that serves /metrics (prometheus-cpp's exposer, civetweb underneath).
class MetricsListener {
 public:
  /// Listens on `address` (host:port; port 0 picks one) and serves `registry`. FAILED_PRECONDITION
  /// naming --metrics-address when it cannot listen.
  static StatusOr<std::unique_ptr<MetricsListener>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);
  /// Stops listening within milliseconds. civetweb looks at its stop flag only between polls of
  /// its listener, up to 2 s apart; connections to the listener while it stops wake it.
  ~MetricsListener();

  int port() const { return port_; }

 private:
  MetricsListener() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string host_;  ///< Where a local connection reaches the listener.
  int port_ = 0;
};

}  // namespace attnserve
