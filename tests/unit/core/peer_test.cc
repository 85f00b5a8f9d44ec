// One name per peer, whether from an accepted socket's address (the connection guard) or from
// gRPC's name of a call's peer (fair shares, per-caller bounds): the two must agree.
#include "server/core/peer.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

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

// The kernel's table, as /proc/net/tcp writes it: 127.0.0.1:40000 -> 127.0.0.1:8000 (uid 1000)
// established, the server's end of it (uid 0), a listener, and a socket of uid 7 closing
// (TIME_WAIT, 06) from the same address and port as another's.
constexpr char kTcp[] =
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout "
    "inode\n"
    "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 "
    "1 0 100 0 0 10 0\n"
    "   1: 0100007F:9C40 0100007F:1F40 01 00000000:00000000 00:00000000 00000000  1000        0 2 "
    "1 0 20 4 30 10 -1\n"
    "   2: 0100007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 3 "
    "1 0 20 4 30 10 -1\n"
    "   3: 0100007F:9C41 0100007F:1F40 06 00000000:00000000 00:00000000 00000000     7        0 0 "
    "3 0 0 0 0 0 0\n";

TEST(PeerTest, TheClientsEndOfALoopbackConnectionNamesItsUid) {
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:40000"), 1000u);
  // gRPC's name of an IPv4 client on a dual-stack listener: the same socket.
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv6:%5B::ffff:127.0.0.1%5D:40000"), 1000u);
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:8000"), 0u);  // The server's own end.
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:40001"), std::nullopt);  // Not established.
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.2:40000"), std::nullopt);
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "unix:/tmp/s"), std::nullopt);
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:x"), std::nullopt);
  EXPECT_EQ(SocketOwnerIn("", false, "ipv4:127.0.0.1:40000"), std::nullopt);
  // Two uids' sockets at the same address and port: no answer rather than a guess.
  const std::string twice = std::string(kTcp) +
                            "   4: 0100007F:9C40 0100007F:1F41 01 00000000:00000000 00:00000000 "
                            "00000000  1001        0 5 1 0 20 4 30 10 -1\n";
  EXPECT_EQ(SocketOwnerIn(twice, false, "ipv4:127.0.0.1:40000"), std::nullopt);
  const char tcp6[] =
      "  sl  local_address                         remote_address                        st "
      "tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
      "   0: 00000000000000000000000001000000:9C40 00000000000000000000000001000000:1F40 01 "
      "00000000:00000000 00:00000000 00000000    42        0 9 1 0 20 4 30 10 -1\n";
  EXPECT_EQ(SocketOwnerIn(tcp6, true, "ipv6:[::1]:40000"), 42u);
}

// A real connection on loopback: its client's socket is this process's (its uid), and the name
// PeerUriOf gives the accepted address finds it.
TEST(PeerTest, ARealLoopbackClientIsFoundByItsAddress) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
  ASSERT_EQ(::listen(listener, 1), 0);
  socklen_t len = sizeof at;
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&at), &len), 0);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
  sockaddr_in peer{};
  len = sizeof peer;
  const int accepted = ::accept(listener, reinterpret_cast<sockaddr*>(&peer), &len);
  ASSERT_GE(accepted, 0);
  const std::string uri = PeerUriOf(reinterpret_cast<sockaddr*>(&peer));
  EXPECT_EQ(uri.rfind("ipv4:127.0.0.1:", 0), 0u) << uri;
  EXPECT_EQ(SocketOwnerOf(uri), ::geteuid()) << uri;
  ::close(client);
  ::close(accepted);
  ::close(listener);
}

}  // namespace
}  // namespace attnserve
