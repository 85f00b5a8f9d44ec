#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <optional>
#include <string>

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

/// The uid that owns the client's end of a TCP connection on this host: the connection whose
/// client is `uri` (gRPC's form of a peer, as PeerUriOf writes it) in the kernel's tables of TCP
/// sockets (/proc/net/tcp and /proc/net/tcp6, this network namespace), found by the client's
/// address and port among established connections. None when `uri` is not a TCP peer, when no
/// such socket is there (the client is on another host, or gone), or when sockets of two uids
/// match.
std::optional<uint32_t> SocketOwnerOf(const std::string& uri);

/// SocketOwnerOf's reading of one table (`table`: /proc/net/tcp's text, or tcp6's with `v6`).
std::optional<uint32_t> SocketOwnerIn(const std::string& table, bool v6, const std::string& uri);

}  // namespace attnserve
