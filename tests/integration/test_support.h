#pragma once
// Helpers shared by the integration tests: a /metrics scrape, random tensors, client options.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnserve/client.h"
#include "server/process/server.h"

namespace attnserve::testing {

inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

// The value of the first sample line that starts with `prefix` (name and labels), or -1.
inline double Sample(const std::string& text, const std::string& prefix) {
  const size_t at = text.find("\n" + prefix);
  if (at == std::string::npos) return -1;
  const size_t space = text.find(' ', at + 1 + prefix.size());
  return std::stod(text.substr(space + 1));
}

inline Tensor RandomTensor(std::mt19937& rng, std::vector<int64_t> shape) {
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<size_t>(
      std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>())));
  for (float& x : v) x = normal(rng);
  return Tensor::Float32(std::move(shape), v);
}

// Client options that reach `server`.
inline ClientOptions TargetOf(const Server& server) {
  ClientOptions c;
  c.target = "127.0.0.1:" + std::to_string(server.port());
  return c;
}

/// Sample() that counts a missing series as 0.
inline double Counter(const std::string& text, const std::string& prefix) {
  return std::max(0.0, Sample(text, prefix));
}

/// Polls `done` every `step` until it holds or `timeout` has passed; whether it held. What a test
/// waits for in place of a fixed time (tests/lib/attnserve_py.py's wait_until, for C++).
template <typename F>
bool WaitUntil(F&& done, std::chrono::milliseconds timeout,
               std::chrono::milliseconds step = std::chrono::milliseconds(10)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(step);
  }
  return true;
}

}  // namespace attnserve::testing
