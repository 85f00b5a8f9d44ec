#include "server/process/metrics_listener.h"

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "server/process/listener_watch.h"

namespace attnserve {

StatusOr<std::unique_ptr<MetricsListener>> MetricsListener::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<MetricsListener> listener(new MetricsListener());
  try {
    // civetweb serves each connection on a thread of its own until the request is read: with its
    // defaults (2 threads, a request may take 30 s to arrive) two clients trickling their
    // requests left /metrics blind for 30 s (a hostile review, 2026-12-05).
    listener->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address, "num_threads", std::to_string(kThreads), "request_timeout_ms",
        std::to_string(kRequestTimeout.count())});
  } catch (const std::exception& e) {
    return Status(StatusCode::kFailedPrecondition,
                  "--metrics-address " + address + ": cannot listen: " + e.what());
  }
  listener->exposer_->RegisterCollectable(registry);
  const auto ports = listener->exposer_->GetListeningPorts();
  listener->port_ = ports.empty() ? 0 : ports.front();
  listener->host_ = LocalHostOf(address);
  return listener;
}

void MetricsListener::Register(std::shared_ptr<prometheus::Collectable> collectable) {
  exposer_->RegisterCollectable(collectable);  // Held weakly there.
  collectables_.push_back(std::move(collectable));
}

MetricsListener::~MetricsListener() {
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      Knock(host_, port_);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  exposer_.reset();
  stopped = true;
  waker.join();
}

}  // namespace attnserve
