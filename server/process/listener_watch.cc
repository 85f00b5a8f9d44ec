#include "server/process/listener_watch.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/process/connection_guard.h"

namespace attnserve {

std::string LocalHostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0" || host == "*") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

bool Knock(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return false;
  bool reached = false;
  for (addrinfo* a = found; a != nullptr && !reached; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    reached = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
  }
  freeaddrinfo(found);
  return reached;
}

ListenerWatch::ListenerWatch(const std::string& address, int port,
                             std::function<void(bool)> on_change,
                             std::chrono::milliseconds interval, std::chrono::milliseconds patience)
    : host_(LocalHostOf(address)),
      port_(port),
      on_change_(std::move(on_change)),
      interval_(interval),
      patience_(patience) {
  if (ConnectionGuard::Installed()) thread_ = std::thread([this] { Run(); });
}

ListenerWatch::~ListenerWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

// Whether the listener accepted a connection since the count was `since`, waiting `within`.
bool ListenerWatch::Accepted(int64_t since, std::chrono::milliseconds within) {
  const auto until = std::chrono::steady_clock::now() + within;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (ConnectionGuard::Get().accepted(port_) > since) return true;
    if (stop_ || std::chrono::steady_clock::now() >= until) return false;
    stop_cv_.wait_for(lock, std::chrono::milliseconds(10));
  }
}

void ListenerWatch::Run() {
  bool accepting = true;
  for (;;) {
    const int64_t before = ConnectionGuard::Get().accepted(port_);
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_cv_.wait_for(lock, interval_, [this] { return stop_; })) return;
    }
    if (ConnectionGuard::Get().accepted(port_) > before) {
      if (!accepting) on_change_(accepting = true);
      continue;
    }
    const int64_t now = ConnectionGuard::Get().accepted(port_);
    Knock(host_, port_);
    const bool took = Accepted(now, patience_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    if (took != accepting) on_change_(accepting = took);
  }
}

}  // namespace attnserve
