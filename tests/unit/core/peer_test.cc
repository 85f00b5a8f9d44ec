// One name per peer, whether from an accepted socket's address (the connection guard) or from
// gRPC's name of a call's peer (fair shares, per-caller bounds): the two must agree.
#include "server/core/peer.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

namespace attnserve {
namespace {

TEST(PeerTest, AnAddressAndGrpcsNameOfItAreTheSamePeer) {
  sockaddr_in v4{};
  v4.sin_family = AF_INET;
  inet_pton(AF_INET, "10.1.2.3", &v4.sin_addr);
  EXPECT_EQ(PeerOf(reinterpret_cast<const sockaddr*>(&v4)), "10.1.2.3");
  EXPECT_EQ(PeerOfUri("ipv4:10.1.2.3:5000"), "10.1.2.3");

  sockaddr_in6 mapped{};
  mapped.sin6_family = AF_INET6;
  inet_pton(AF_INET6, "::ffff:10.1.2.3", &mapped.sin6_addr);
  EXPECT_EQ(PeerOf(reinterpret_cast<const sockaddr*>(&mapped)), "10.1.2.3");
  EXPECT_EQ(PeerOfUri("ipv6:%5B::ffff:10.1.2.3%5D:5000"), "10.1.2.3");

  // Every address of one /64 is one peer; another /64 is another.
  sockaddr_in6 v6{};
  v6.sin6_family = AF_INET6;
  inet_pton(AF_INET6, "2001:db8:77:1::abcd", &v6.sin6_addr);
  EXPECT_EQ(PeerOf(reinterpret_cast<const sockaddr*>(&v6)), "2001:db8:77:1::/64");
  EXPECT_EQ(PeerOfUri("ipv6:%5B2001:db8:77:1:ffff::1%5D:443"), "2001:db8:77:1::/64");
  EXPECT_EQ(PeerOfUri("ipv6:[2001:db8:77:2::1]:443"), "2001:db8:77:2::/64");
  EXPECT_EQ(PeerOfUri("ipv6:%5B::1%5D:5000"), "::/64");

  EXPECT_EQ(PeerOfUri("unix:/tmp/socket"), "unix");
  EXPECT_EQ(PeerOfUri("unix-abstract:name"), "unix");
  EXPECT_EQ(PeerOfUri("something:else"), "something");  // Unreadable: without its port.
}

}  // namespace
}  // namespace attnserve
