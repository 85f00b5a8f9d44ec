// attnserve-wire-floor: the floor under a call's transport on this host, in the same run as the
// servers: N bytes sent over a plain socket and N bytes answered back (a loopback TCP connection
// with TCP_NODELAY, or a Unix domain socket), no framing beyond an 8-byte length, no copies beyond
// the system calls'. What any RPC of those bytes each way costs at the least here.
//   attnserve-wire-floor serve --address tcp:127.0.0.1:50400 | unix:/tmp/floor.sock
//   attnserve-wire-floor ping --address ... --bytes 2097152 --rounds 200 [--json FILE --label L]
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Address {
  bool unix_socket = false;
  std::string path;   // unix
  uint16_t port = 0;  // tcp, on 127.0.0.1
};

Address Parse(const std::string& a) {
  Address out;
  if (a.rfind("unix:", 0) == 0) {
    out.unix_socket = true;
    out.path = a.substr(5);
    return out;
  }
  const std::string rest = a.rfind("tcp:", 0) == 0 ? a.substr(4) : a;
  out.port = static_cast<uint16_t>(std::stoi(rest.substr(rest.rfind(':') + 1)));
  return out;
}

int Socket(const Address& a, bool listen_on) {
  const int fd = socket(a.unix_socket ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (a.unix_socket) {
    auto* un = reinterpret_cast<sockaddr_un*>(&ss);
    un->sun_family = AF_UNIX;
    std::snprintf(un->sun_path, sizeof(un->sun_path), "%s", a.path.c_str());
    len = sizeof(sockaddr_un);
    if (listen_on) unlink(a.path.c_str());
  } else {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    in->sin_family = AF_INET;
    in->sin_port = htons(a.port);
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    len = sizeof(sockaddr_in);
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  }
  const auto* sa = reinterpret_cast<const sockaddr*>(&ss);
  if (listen_on ? (bind(fd, sa, len) != 0 || listen(fd, 16) != 0) : connect(fd, sa, len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void NoDelay(int fd, const Address& a) {
  const int one = 1;
  if (!a.unix_socket) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool ReadAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Each connection on a thread of its own: a length, that many bytes in, as many back.
int Serve(const Address& a) {
  const int lfd = Socket(a, true);
  if (lfd < 0) {
    std::perror("attnserve-wire-floor: listen");
    return 2;
  }
  std::printf("attnserve-wire-floor: serving\n");
  std::fflush(stdout);
  for (;;) {
    const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    NoDelay(fd, a);
    std::thread([fd] {
      std::vector<char> buf;
      uint64_t n = 0;
      while (ReadAll(fd, reinterpret_cast<char*>(&n), sizeof(n)) && n <= (uint64_t{1} << 30)) {
        buf.resize(n);
        if (!ReadAll(fd, buf.data(), n) || !WriteAll(fd, buf.data(), n)) break;
      }
      close(fd);
    }).detach();
  }
}

int Ping(const Address& a, size_t bytes, int rounds, int callers, const std::string& json,
         const std::string& label) {
  std::vector<std::vector<double>> us(static_cast<size_t>(callers));
  std::vector<std::thread> ts;
  bool failed = false;
  const auto start = std::chrono::steady_clock::now();
  for (int c = 0; c < callers; ++c) {
    ts.emplace_back([&, c] {
      const int fd = Socket(a, false);
      if (fd < 0) {
        failed = true;
        return;
      }
      NoDelay(fd, a);
      std::vector<char> out(bytes, 'x'), in(bytes);
      const uint64_t n = bytes;
      for (int r = 0; r < rounds + 5; ++r) {  // The first 5: warm-up.
        const auto t0 = std::chrono::steady_clock::now();
        if (!WriteAll(fd, reinterpret_cast<const char*>(&n), sizeof(n)) ||
            !WriteAll(fd, out.data(), bytes) || !ReadAll(fd, in.data(), bytes)) {
          failed = true;
          break;
        }
        if (r >= 5) {
          us[static_cast<size_t>(c)].push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                  .count());
        }
      }
      close(fd);
    });
  }
  for (auto& t : ts) t.join();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (failed) {
    std::fprintf(stderr, "attnserve-wire-floor: a round trip failed\n");
    return 1;
  }
  std::vector<double> all;
  for (auto& v : us) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  const double p50 = all[all.size() / 2] / 1e3, p90 = all[all.size() * 9 / 10] / 1e3;
  const double per_s = static_cast<double>(all.size()) / wall;
  std::printf(
      "%-24s %10zu bytes each way  %9.0f round trips/s  p50 %8.3f ms  p90 %8.3f ms  "
      "%7.2f GB/s each way\n",
      label.c_str(), bytes, per_s, p50, p90, per_s * static_cast<double>(bytes) / 1e9);
  if (!json.empty()) {
    std::ofstream(json, std::ios::app)
        << "{\"label\": \"" << label << "\", \"bytes\": " << bytes << ", \"callers\": " << callers
        << ", \"round_trips_per_s\": " << per_s << ", \"p50_ms\": " << p50
        << ", \"p90_ms\": " << p90 << "}\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attnserve-wire-floor: bytes each way over a plain socket (the transport's floor)"};
  std::string mode, address = "tcp:127.0.0.1:50400", json, label = "floor";
  size_t bytes = 1 << 21;
  int rounds = 200, callers = 1;
  app.add_option("mode", mode, "serve | ping")->required()->check(CLI::IsMember({"serve", "ping"}));
  app.add_option("--address", address, "tcp:127.0.0.1:PORT or unix:PATH")->capture_default_str();
  app.add_option("--bytes", bytes, "ping: bytes each way")->capture_default_str();
  app.add_option("--rounds", rounds, "ping: round trips a caller")->capture_default_str();
  app.add_option("--callers", callers, "ping: callers, a connection each")->capture_default_str();
  app.add_option("--json", json, "ping: append the result as a JSON line here");
  app.add_option("--label", label, "ping: its name in the output")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const Address a = Parse(address);
  return mode == "serve" ? Serve(a) : Ping(a, bytes, rounds, callers, json, label);
}
