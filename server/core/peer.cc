#include "server/core/peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <utility>

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

std::string PeerOfUri(const std::string& uri) {
  std::string peer = uri;
  for (const auto& [escaped, bracket] : {std::pair{"%5B", "["}, std::pair{"%5D", "]"}}) {
    for (size_t at; (at = peer.find(escaped)) != std::string::npos;) peer.replace(at, 3, bracket);
  }
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

}  // namespace attnserve
