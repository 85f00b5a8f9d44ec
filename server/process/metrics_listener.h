#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "server/core/status.h"

namespace prometheus {
class Collectable;
class Exposer;
class Registry;
}  // namespace prometheus

namespace attnserve {

/// The HTTP listener that serves /metrics (prometheus-cpp's exposer, civetweb underneath).
class MetricsListener {
 public:
  /// Connections served at once; each holds a thread until its request has arrived.
  static constexpr int kThreads = 8;
  /// The longest a request may take to arrive whole (and each read or write of its answer).
  static constexpr std::chrono::milliseconds kRequestTimeout{5000};
  /// Listens on `address` (host:port; port 0 picks one) and serves `registry`. FAILED_PRECONDITION
  /// naming --metrics-address when it cannot listen.
  static StatusOr<std::unique_ptr<MetricsListener>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);
  /// Stops listening within milliseconds. civetweb looks at its stop flag only between polls of
  /// its listener, up to 2 s apart; connections to the listener while it stops wake it.
  ~MetricsListener();

  int port() const { return port_; }
  /// Serves `collectable`'s series too (read at each scrape).
  void Register(std::shared_ptr<prometheus::Collectable> collectable);

 private:
  MetricsListener() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_;  // Served (Register).
  std::string host_;  ///< Where a local connection reaches the listener.
  int port_ = 0;
};

}  // namespace attnserve
