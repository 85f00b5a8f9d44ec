#pragma once

#include <sys/socket.h>

#include <string>

namespace attnserve {

/// Who a connection's client is, as one name for every bound and share kept per peer: an IPv4
/// address ("10.1.2.3"; IPv4 mapped into IPv6 is written so too), an IPv6 address's /64
/// ("2001:db8::/64": one host is commonly given a whole /64), or "unix".
std::string PeerOf(const sockaddr* address);
/// The same from gRPC's name of a call's peer ("ipv4:10.1.2.3:5000", "ipv6:%5B::1%5D:5000",
/// "unix:/path"); a name it cannot read is returned without its port.
std::string PeerOfUri(const std::string& uri);

}  // namespace attnserve
