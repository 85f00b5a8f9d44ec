#include "server/core/peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

namespace attnserve {

std::string PeerOf(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(address)->sin_addr, text, sizeof text);
    return text;
  }
  if (address->sa_family != AF_INET6) return "unix";
  in6_addr a = reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr;
  if (IN6_IS_ADDR_V4MAPPED(&a)) {
    inet_ntop(AF_INET, a.s6_addr + 12, text, sizeof text);
    return text;
  }
  std::memset(a.s6_addr + 8, 0, 8);
  inet_ntop(AF_INET6, &a, text, sizeof text);
  return std::string(text) + "/64";
}

namespace {

// gRPC's name of a peer with an IPv6 address's brackets unescaped: "ipv6:%5B::1%5D:5000" reads
// "ipv6:[::1]:5000".
std::string Unbracketed(const std::string& uri) {
  std::string peer = uri;
  for (const auto& [escaped, bracket] : {std::pair{"%5B", "["}, std::pair{"%5D", "]"}}) {
    for (size_t at; (at = peer.find(escaped)) != std::string::npos;) peer.replace(at, 3, bracket);
  }
  return peer;
}

}  // namespace

std::string PeerOfUri(const std::string& uri) {
  std::string peer = Unbracketed(uri);
  if (peer.rfind("unix", 0) == 0) return "unix";
  for (const char* scheme : {"ipv4:", "ipv6:"}) {
    if (peer.rfind(scheme, 0) == 0) peer = peer.substr(5);
  }
  std::string host = peer;
  if (!peer.empty() && peer.front() == '[') {  // [address]:port
    const size_t close = peer.find(']');
    host = close == std::string::npos ? peer.substr(1) : peer.substr(1, close - 1);
  } else if (const size_t colon = peer.rfind(':'); colon != std::string::npos) {
    host = peer.substr(0, colon);
  }
  sockaddr_in6 v6{};
  sockaddr_in v4{};
  if (inet_pton(AF_INET6, host.c_str(), &v6.sin6_addr) == 1) {
    v6.sin6_family = AF_INET6;
    return PeerOf(reinterpret_cast<const sockaddr*>(&v6));
  }
  if (inet_pton(AF_INET, host.c_str(), &v4.sin_addr) == 1) {
    v4.sin_family = AF_INET;
    return PeerOf(reinterpret_cast<const sockaddr*>(&v4));
  }
  return host;
}

std::string PeerUriOf(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(address);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
    return "ipv4:" + std::string(text) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (address->sa_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(address);
    inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
    return "ipv6:[" + std::string(text) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  return "unix:";
}

namespace {

// A TCP peer's address (16 bytes: IPv4 mapped into IPv6) and port, from gRPC's form.
struct TcpEndpoint {
  in6_addr address{};
  int port = -1;
};

std::optional<TcpEndpoint> EndpointOf(const std::string& uri) {
  const std::string peer = Unbracketed(uri);
  std::string host, port;
  if (peer.rfind("ipv4:", 0) == 0) {
    const size_t colon = peer.rfind(':');
    host = peer.substr(5, colon - 5);
    port = peer.substr(colon + 1);
  } else if (peer.rfind("ipv6:[", 0) == 0) {
    const size_t close = peer.find("]:");
    if (close == std::string::npos) return std::nullopt;
    host = peer.substr(6, close - 6);
    port = peer.substr(close + 2);
  } else {
    return std::nullopt;
  }
  TcpEndpoint e;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    e.address.s6_addr[10] = e.address.s6_addr[11] = 0xff;
    std::memcpy(e.address.s6_addr + 12, &v4, 4);
  } else if (inet_pton(AF_INET6, host.c_str(), &e.address) != 1) {
    return std::nullopt;
  }
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p < 0 || p > 65535) return std::nullopt;
  e.port = static_cast<int>(p);
  return e;
}

// "0100007F:1F90" (the kernel's words in host order, then the port) as an endpoint.
std::optional<TcpEndpoint> EndpointInTable(const std::string& field, bool v6) {
  const size_t colon = field.find(':');
  const size_t hex_len = v6 ? 32 : 8;
  if (colon != hex_len) return std::nullopt;
  TcpEndpoint e;
  uint8_t bytes[16] = {};
  for (size_t w = 0; w < hex_len / 8; ++w) {
    char* end = nullptr;
    const std::string word = field.substr(w * 8, 8);
    const uint32_t v = static_cast<uint32_t>(std::strtoul(word.c_str(), &end, 16));
    if (*end != '\0') return std::nullopt;
    std::memcpy(bytes + 4 * w, &v, 4);  // As the kernel holds it in memory.
  }
  if (v6) {
    std::memcpy(e.address.s6_addr, bytes, 16);
  } else {
    e.address.s6_addr[10] = e.address.s6_addr[11] = 0xff;
    std::memcpy(e.address.s6_addr + 12, bytes, 4);
  }
  char* end = nullptr;
  e.port = static_cast<int>(std::strtol(field.c_str() + colon + 1, &end, 16));
  if (*end != '\0') return std::nullopt;
  return e;
}

// One key per TCP endpoint whichever way it is written: gRPC writes an IPv4 client of a dual-stack
// listener as "ipv4:127.0.0.1:5000", the socket's own address reads "::ffff:127.0.0.1".
std::string EndpointKey(const std::string& uri) {
  const std::optional<TcpEndpoint> e = EndpointOf(uri);
  if (!e) return uri;
  std::string key(e->address.s6_addr, e->address.s6_addr + 16);
  return key + ":" + std::to_string(e->port);
}

}  // namespace

std::optional<uint32_t> SocketOwnerIn(const std::string& table, bool v6,
                                      const std::string& client_uri,
                                      const std::string& server_uri) {
  const std::optional<TcpEndpoint> client = EndpointOf(client_uri);
  const std::optional<TcpEndpoint> server = EndpointOf(server_uri);
  if (!client || !server) return std::nullopt;
  const auto same = [](const std::optional<TcpEndpoint>& a, const TcpEndpoint& b) {
    return a && a->port == b.port && std::memcmp(&a->address, &b.address, 16) == 0;
  };
  std::set<uint32_t> uids;
  std::istringstream lines(table);
  std::string line;
  std::getline(lines, line);  // The heading.
  while (std::getline(lines, line)) {
    // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
    std::istringstream fields(line);
    std::vector<std::string> f(10);
    for (std::string& x : f) fields >> x;
    // A socket a process holds (inode not 0), not waiting out its close (TIME_WAIT 06), closed
    // (07) or listening (0A).
    if (f[9].empty() || f[9] == "0" || f[3] == "06" || f[3] == "07" || f[3] == "0A") continue;
    if (!same(EndpointInTable(f[1], v6), *client) || !same(EndpointInTable(f[2], v6), *server))
      continue;
    char* end = nullptr;
    const unsigned long uid = std::strtoul(f[7].c_str(), &end, 10);
    if (*end == '\0') uids.insert(static_cast<uint32_t>(uid));
  }
  if (uids.size() != 1) return std::nullopt;
  return *uids.begin();
}

std::optional<uint32_t> SocketOwnerOf(const std::string& client_uri,
                                      const std::string& server_uri) {
  std::set<uint32_t> found;
  for (const auto& [path, v6] :
       {std::pair{"/proc/net/tcp", false}, std::pair{"/proc/net/tcp6", true}}) {
    std::ifstream in(path);
    if (!in) continue;
    std::ostringstream text;
    text << in.rdbuf();
    if (std::optional<uint32_t> uid = SocketOwnerIn(text.str(), v6, client_uri, server_uri))
      found.insert(*uid);
  }
  if (found.size() != 1) return std::nullopt;
  return *found.begin();
}

ConnectionEnds& ConnectionEnds::Get() {
  static ConnectionEnds* ends = new ConnectionEnds;
  return *ends;
}

bool ConnectionEnds::Add(int fd) {
  sockaddr_storage client{}, server{};
  socklen_t n = sizeof client, m = sizeof server;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&client), &n) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&server), &m) != 0 ||
      (client.ss_family != AF_INET && client.ss_family != AF_INET6)) {
    return true;
  }
  const std::string client_uri = PeerUriOf(reinterpret_cast<const sockaddr*>(&client));
  const std::string server_uri = PeerUriOf(reinterpret_cast<const sockaddr*>(&server));
  std::lock_guard<std::mutex> lock(mu_);
  Forget(fd);  // A descriptor reused unannounced.
  const std::string key = EndpointKey(client_uri);
  const bool alone = by_client_.count(key) == 0;
  by_fd_[fd] = {key, server_uri};
  by_client_.emplace(key, fd);
  return alone;
}

void ConnectionEnds::Remove(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  Forget(fd);
}

void ConnectionEnds::Forget(int fd) {
  const auto at = by_fd_.find(fd);
  if (at == by_fd_.end()) return;
  for (auto [it, end] = by_client_.equal_range(at->second.first); it != end; ++it) {
    if (it->second == fd) {
      by_client_.erase(it);
      break;
    }
  }
  by_fd_.erase(at);
}

std::optional<std::string> ConnectionEnds::ServerEndOf(const std::string& client_uri) const {
  const std::string uri = EndpointKey(client_uri);
  std::lock_guard<std::mutex> lock(mu_);
  if (by_client_.count(uri) != 1) return std::nullopt;
  return by_fd_.at(by_client_.find(uri)->second).second;
}

}  // namespace attnserve
