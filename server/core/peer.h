#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace attnserve {

/// Who a connection's client is, as one name for every bound and share kept per peer: an IPv4
/// address ("10.1.2.3"; IPv4 mapped into IPv6 is written so too), an IPv6 address's /64
/// ("2001:db8::/64": one host is commonly given a whole /64), or "unix".
std::string PeerOf(const sockaddr* address);
/// The same from gRPC's name of a call's peer ("ipv4:10.1.2.3:5000", "ipv6:%5B::1%5D:5000",
/// "unix:/path"); a name it cannot read is returned without its port.
std::string PeerOfUri(const std::string& uri);

/// `address` (IPv4 or IPv6, with its port) in gRPC's form of a peer: "ipv4:127.0.0.1:5000",
/// "ipv6:[::1]:5000"; "unix:" for anything else.
std::string PeerUriOf(const sockaddr* address);

/// The uid that owns the client's end of a TCP connection on this host: the socket whose own
/// address is `client_uri` and whose peer is `server_uri` (both in gRPC's form of a peer, as
/// PeerUriOf writes them; the server's end is ConnectionEnds::ServerEndOf's) in the kernel's
/// tables of TCP sockets (/proc/net/tcp and /proc/net/tcp6, this network namespace), still held
/// by a process (an orphaned or TIME_WAIT socket is owned by no one and reads as uid 0). None when
/// either is not a TCP endpoint, or no such socket is there (the client is on another host, or
/// gone).
std::optional<uint32_t> SocketOwnerOf(const std::string& client_uri, const std::string& server_uri);

/// SocketOwnerOf's reading of one table (`table`: /proc/net/tcp's text, or tcp6's with `v6`).
std::optional<uint32_t> SocketOwnerIn(const std::string& table, bool v6,
                                      const std::string& client_uri, const std::string& server_uri);

/// The server ends of this process's open TCP connections, by their clients' endpoints: what ties
/// a call, which knows only its peer (gRPC's form), to the connection it came on. Thread-safe.
class ConnectionEnds {
 public:
  static ConnectionEnds& Get();
  /// Records accepted connection `fd`'s two ends (nothing for a socket that is not TCP). False when
  /// another open connection has the same client endpoint (a client bound where another is,
  /// connected to another of this host's addresses): a listener that can refuses it, since calls
  /// from either could not be told apart.
  bool Add(int fd);
  /// `fd` is closing.
  void Remove(int fd);
  /// The server's end of the one open connection from `client_uri`; none when no open connection,
  /// or more than one, has that client endpoint.
  std::optional<std::string> ServerEndOf(const std::string& client_uri) const;

 private:
  void Forget(int fd);  // Under mu_.

  mutable std::mutex mu_;
  std::map<int, std::pair<std::string, std::string>> by_fd_;  // fd: client end's key, server end
  std::multimap<std::string, int> by_client_;
};

}  // namespace attnserve
