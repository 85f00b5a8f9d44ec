// attnserve-http-library: the HTTP/1.1 libraries Debian ships, measured side by side in one run on
// what attnserve's HTTP port needs of them (docs/benchmarks.md "HTTP library"): a POST of N bytes
// echoed back on a keep-alive connection (p50 and p90 of the round trip, one caller and four), the
// same while 256 idle connections are open, and whether a client that sends its headers one byte
// a second is dropped. Each library serves with two threads, as on a 2-core host.
//   attnserve-http-library [--rounds 300] [--json FILE]
#include <civetweb.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// ---- libmicrohttpd: one epoll thread per pool slot, the body handed over in pieces. ----
struct MhdBody {
  std::string bytes;
};

MHD_Result MhdEcho(void*, MHD_Connection* c, const char*, const char*, const char*,
                   const char* upload, size_t* upload_size, void** state) {
  if (*state == nullptr) {
    *state = new MhdBody;
    return MHD_YES;
  }
  auto* body = static_cast<MhdBody*>(*state);
  if (*upload_size > 0) {
    body->bytes.append(upload, *upload_size);
    *upload_size = 0;
    return MHD_YES;
  }
  auto* out = new std::string(std::move(body->bytes));
  MHD_Response* r = MHD_create_response_from_buffer_with_free_callback_cls(
      out->size(), out->data(), [](void* p) { delete static_cast<std::string*>(p); }, out);
  const MHD_Result ok = MHD_queue_response(c, 200, r);
  MHD_destroy_response(r);
  return ok;
}

void MhdDone(void*, MHD_Connection*, void** state, MHD_RequestTerminationCode) {
  delete static_cast<MhdBody*>(*state);
  *state = nullptr;
}

struct Server {
  std::string name;
  std::function<void()> stop;
};

size_t MemoryLimit() {
  const char* e = std::getenv("MHD_MEM");
  return e ? std::stoul(e) : 32768;
}

Server StartMhd(uint16_t port) {
  MHD_Daemon* d = MHD_start_daemon(
      MHD_USE_EPOLL_INTERNAL_THREAD, port, nullptr, nullptr, &MhdEcho, nullptr,
      MHD_OPTION_THREAD_POOL_SIZE, 2u, MHD_OPTION_CONNECTION_TIMEOUT, 5u,
      MHD_OPTION_CONNECTION_LIMIT, 1024u, MHD_OPTION_NOTIFY_COMPLETED, &MhdDone, nullptr,
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, size_t{MemoryLimit()}, MHD_OPTION_END);
  if (d == nullptr) throw std::runtime_error("libmicrohttpd did not start");
  return {std::string("libmicrohttpd ") + MHD_get_version(), [d] { MHD_stop_daemon(d); }};
}

// ---- civetweb: a thread per connection from a fixed pool, the body read by the handler. ----
int CivetEcho(mg_connection* c, void*) {
  const mg_request_info* info = mg_get_request_info(c);
  std::string body(static_cast<size_t>(std::max<long long>(0, info->content_length)), '\0');
  size_t got = 0;
  while (got < body.size()) {
    const int n = mg_read(c, body.data() + got, body.size() - got);
    if (n <= 0) return 400;
    got += static_cast<size_t>(n);
  }
  mg_printf(c,
            "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nContent-Type: "
            "application/octet-stream\r\n\r\n",
            body.size());
  mg_write(c, body.data(), body.size());
  return 200;
}

Server StartCivet(uint16_t port) {
  const std::string ports = "127.0.0.1:" + std::to_string(port);
  const char* options[] = {"listening_ports",
                           ports.c_str(),
                           "num_threads",
                           "2",
                           "request_timeout_ms",
                           "5000",
                           "enable_keep_alive",
                           "yes",
                           "keep_alive_timeout_ms",
                           "5000",
                           "tcp_nodelay",
                           "1",
                           nullptr};
  mg_callbacks callbacks{};
  mg_context* ctx = mg_start(&callbacks, nullptr, options);
  if (ctx == nullptr) throw std::runtime_error("civetweb did not start");
  mg_set_request_handler(ctx, "/echo", &CivetEcho, nullptr);
  return {std::string("civetweb ") + mg_version(), [ctx] { mg_stop(ctx); }};
}

// ---- The client: plain sockets, HTTP/1.1 keep-alive. ----
int Connect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// One POST /echo and its answer; false when the connection failed or answered wrong.
bool RoundTrip(int fd, const std::string& body, std::string* buf) {
  const std::string head =
      "POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\n\r\n";
  if (!SendAll(fd, head.data(), head.size()) || !SendAll(fd, body.data(), body.size()))
    return false;
  buf->clear();
  size_t header_end = std::string::npos, want = 0;
  char chunk[1 << 16];
  while (true) {
    const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
    if (n <= 0) return false;
    buf->append(chunk, static_cast<size_t>(n));
    if (header_end == std::string::npos) {
      header_end = buf->find("\r\n\r\n");
      if (header_end == std::string::npos) continue;
      std::string lower = buf->substr(0, header_end);
      std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
      const size_t cl = lower.find("content-length:");
      if (cl == std::string::npos) return false;
      want = header_end + 4 + std::stoull(lower.substr(cl + 15));
    }
    if (buf->size() >= want) return buf->size() == want;
  }
}

struct Timing {
  double p50_ms = 0, p90_ms = 0;
  bool ok = true;
};

Timing Measure(uint16_t port, size_t bytes, int callers, int rounds) {
  std::vector<std::vector<double>> per(static_cast<size_t>(callers));
  std::atomic<bool> ok{true};
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c) {
    threads.emplace_back([&, c] {
      const int fd = Connect(port);
      const std::string body(bytes, static_cast<char>('a' + c));
      std::string buf;
      for (int i = 0; i < rounds + 5 && fd >= 0; ++i) {
        const auto t0 = Clock::now();
        if (!RoundTrip(fd, body, &buf)) {
          ok = false;
          break;
        }
        if (i >= 5)
          per[c].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
      if (fd < 0) ok = false;
      if (fd >= 0) close(fd);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<double> all;
  for (auto& v : per) all.insert(all.end(), v.begin(), v.end());
  Timing t;
  t.ok = ok && !all.empty();
  if (all.empty()) return t;
  std::sort(all.begin(), all.end());
  t.p50_ms = all[all.size() / 2];
  t.p90_ms = all[all.size() * 9 / 10];
  return t;
}

// Seconds until the server drops a client that sends a header byte a second (capped at 30).
double SlowHeaderDrop(uint16_t port) {
  const int fd = Connect(port);
  const std::string head = "POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
  const auto t0 = Clock::now();
  for (size_t i = 0; i < 30; ++i) {
    if (send(fd, &head[i % head.size()], 1, MSG_NOSIGNAL) <= 0) break;
    timeval tv{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char c;
    const ssize_t n = recv(fd, &c, 1, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) break;
  }
  close(fd);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"HTTP libraries side by side"};
  int rounds = 300;
  std::string json_path;
  app.add_option("--rounds", rounds, "round trips per caller and size");
  app.add_option("--json", json_path, "write the figures here too");
  CLI11_PARSE(app, argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("%-22s %9s %7s %9s %9s\n", "library", "bytes", "callers", "p50 ms", "p90 ms");
  std::string json = "[";
  const std::vector<std::function<Server(uint16_t)>> starts = {&StartMhd, &StartCivet};
  uint16_t port = 50610;
  for (const auto& start : starts) {
    ++port;
    Server s = start(port);
    const auto row = [&](const std::string& what, size_t bytes, int callers) {
      const Timing t = Measure(port, bytes, callers, rounds);
      std::printf("%-22s %9zu %7d %9.3f %9.3f %s%s\n", s.name.c_str(), bytes, callers, t.p50_ms,
                  t.p90_ms, t.ok ? "" : "FAILED ", what.c_str());
      json += std::string(json.size() > 1 ? "," : "") + "{\"library\":\"" + s.name +
              "\",\"bytes\":" + std::to_string(bytes) + ",\"callers\":" + std::to_string(callers) +
              ",\"case\":\"" + what + "\",\"ok\":" + (t.ok ? "true" : "false") +
              ",\"p50_ms\":" + std::to_string(t.p50_ms) + "}";
    };
    for (size_t bytes : {size_t{16} << 10, size_t{256} << 10, size_t{2} << 20}) {
      row("", bytes, 1);
      row("", bytes, 4);
    }
    // 256 idle keep-alive connections open: is a new caller still served, and how fast?
    std::vector<int> idle;
    for (int i = 0; i < 256; ++i) idle.push_back(Connect(port));
    if (s.name.rfind("civetweb", 0) != 0 || std::getenv("CIVET_IDLE"))
      row("with 256 idle connections", size_t{16} << 10, 1);
    for (int fd : idle)
      if (fd >= 0) close(fd);
    const double slow = SlowHeaderDrop(port);
    std::printf("%-22s slow header (a byte a second) dropped after %.1f s%s\n", s.name.c_str(),
                slow, slow >= 29.5 ? " (never, capped)" : "");
    json += ",{\"library\":\"" + s.name +
            "\",\"case\":\"slow header dropped after s\",\"s\":" + std::to_string(slow) + "}";
    s.stop();
  }
  json += "]\n";
  if (!json_path.empty()) std::ofstream(json_path) << json;
  return 0;
}
