#include "server/process/metrics_listener.h"

#include <netdb.h>
#include <prometheus/exposer.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace attnserve {
namespace {

// The host part of host:port, brackets dropped; a wildcard becomes the loopback of its family.
std::string LocalHostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0" || host == "*") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// Opens and closes one TCP connection to host:port; failures do not matter.
void Knock(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const bool reached = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (reached) break;
  }
  freeaddrinfo(found);
}

}  // namespace

StatusOr<std::unique_ptr<MetricsListener>> MetricsListener::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<MetricsListener> listener(new MetricsListener());
  try {
    listener->exposer_ = std::make_unique<prometheus::Exposer>(address);
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
