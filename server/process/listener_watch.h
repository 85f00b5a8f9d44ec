#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace attnserve {

/// The host part of host:port, brackets dropped; a wildcard becomes the loopback of its family:
/// where a connection from this host reaches a listener on `address`.
std::string LocalHostOf(const std::string& address);
/// Opens and closes one TCP connection to host:port; false when it could not connect.
bool Knock(const std::string& host, int port);

/// Watches that a gRPC listener still takes connections (the connection guard counts what it
/// accepts), so that health tells the truth when it no longer does: after each `interval` in which
/// it accepted nothing, the watch connects to it and waits up to `patience` for that connection to
/// be accepted. `on_change(false)` when it is not, `on_change(true)` once connections are accepted
/// again. Needs the connection guard's interposers (does nothing without them). Thread-safe; stops
/// when destroyed.
class ListenerWatch {
 public:
  ListenerWatch(const std::string& address, int port, std::function<void(bool)> on_change,
                std::chrono::milliseconds interval = std::chrono::milliseconds(2000),
                std::chrono::milliseconds patience = std::chrono::milliseconds(1000));
  ~ListenerWatch();
  ListenerWatch(const ListenerWatch&) = delete;
  ListenerWatch& operator=(const ListenerWatch&) = delete;

 private:
  void Run();
  bool Accepted(int64_t since, std::chrono::milliseconds within);

  const std::string host_;
  const int port_;
  const std::function<void(bool)> on_change_;
  const std::chrono::milliseconds interval_, patience_;
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace attnserve
