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
// established, the server's end of it (uid 0), a listener; the same client address and port
// connected to 127.0.0.2:8000 by uid 7 (a socket bound where another is), and orphaned (inode 0,
// uid 0 as the kernel writes a socket no process holds) from 127.0.0.1:40001.
constexpr char kTcp[] =
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout "
    "inode\n"
    "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 "
    "1 0 100 0 0 10 0\n"
    "   1: 0100007F:9C40 0100007F:1F40 01 00000000:00000000 00:00000000 00000000  1000        0 2 "
    "1 0 20 4 30 10 -1\n"
    "   2: 0100007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 3 "
    "1 0 20 4 30 10 -1\n"
    "   3: 0100007F:9C40 0200007F:1F40 05 00000000:00000000 00:00000000 00000000     7        0 4 "
    "1 0 20 4 30 10 -1\n"
    "   4: 0100007F:9C41 0100007F:1F40 05 00000000:00000000 00:00000000 00000000     0        0 0 "
    "1 0 20 4 30 10 -1\n";

TEST(PeerTest, TheClientsEndOfALoopbackConnectionNamesItsUid) {
  const std::string server = "ipv4:127.0.0.1:8000";
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:40000", server), 1000u);
  // gRPC's name of an IPv4 client on a dual-stack listener: the same socket.
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv6:%5B::ffff:127.0.0.1%5D:40000",
                          "ipv6:[::ffff:127.0.0.1]:8000"),
            1000u);
  // The same client end connected elsewhere is another socket: by its server end, uid 7's.
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:40000", "ipv4:127.0.0.2:8000"), 7u);
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:40000", "ipv4:127.0.0.1:8001"),
            std::nullopt);
  // Orphaned (its process closed it): uid 0 in the table, owned by no one.
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:40001", server), std::nullopt);
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.2:40000", server), std::nullopt);
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "unix:/tmp/s", server), std::nullopt);
  EXPECT_EQ(SocketOwnerIn(kTcp, false, "ipv4:127.0.0.1:x", server), std::nullopt);
  EXPECT_EQ(SocketOwnerIn("", false, "ipv4:127.0.0.1:40000", server), std::nullopt);
  const char tcp6[] =
      "  sl  local_address                         remote_address                        st "
      "tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
      "   0: 00000000000000000000000001000000:9C40 00000000000000000000000001000000:1F40 01 "
      "00000000:00000000 00:00000000 00000000    42        0 9 1 0 20 4 30 10 -1\n";
  EXPECT_EQ(SocketOwnerIn(tcp6, true, "ipv6:[::1]:40000", "ipv6:[::1]:8000"), 42u);
}

// Connections on loopback to a listener here: each connection's ends as accept sees them.
struct Loopback {
  int listener = -1;
  sockaddr_in at{};
  explicit Loopback(const char* address = "127.0.0.1") {
    listener = ::socket(AF_INET, SOCK_STREAM, 0);
    at.sin_family = AF_INET;
    inet_pton(AF_INET, address, &at.sin_addr);
    EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    EXPECT_EQ(::listen(listener, 4), 0);
    socklen_t len = sizeof at;
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&at), &len);
  }
  ~Loopback() { ::close(listener); }
  // A client (bound at `from`'s address and port when given), and the accepted end. Bound first
  // either way: a port connect() picks may be shared with other processes' connections elsewhere
  // (tests run side by side), and a second client could not bind where the first is; one bind()
  // picks is its own.
  std::pair<int, int> Connect(const sockaddr_in* from = nullptr) const {
    const int client = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(client, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in any{};
    any.sin_family = AF_INET;
    any.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const sockaddr_in* at_client = from != nullptr ? from : &any;
    EXPECT_EQ(::bind(client, reinterpret_cast<const sockaddr*>(at_client), sizeof *at_client), 0);
    EXPECT_EQ(::connect(client, reinterpret_cast<const sockaddr*>(&at), sizeof at), 0);
    return {client, ::accept(listener, nullptr, nullptr)};
  }
};

std::string ClientUri(int accepted) {
  sockaddr_in peer{};
  socklen_t len = sizeof peer;
  ::getpeername(accepted, reinterpret_cast<sockaddr*>(&peer), &len);
  return PeerUriOf(reinterpret_cast<sockaddr*>(&peer));
}

// A real connection on loopback: its client's socket is this process's (its uid), found by the
// ends ConnectionEnds recorded.
TEST(PeerTest, ARealLoopbackClientIsFoundByItsConnectionsEnds) {
  const Loopback server;
  const auto [client, accepted] = server.Connect();
  ASSERT_GE(accepted, 0);
  const std::string uri = ClientUri(accepted);
  EXPECT_EQ(uri.rfind("ipv4:127.0.0.1:", 0), 0u) << uri;
  EXPECT_EQ(ConnectionEnds::Get().ServerEndOf(uri), std::nullopt);  // Not recorded yet.
  EXPECT_TRUE(ConnectionEnds::Get().Add(accepted));
  const std::optional<std::string> end = ConnectionEnds::Get().ServerEndOf(uri);
  ASSERT_TRUE(end.has_value());
  // gRPC's name of the same client on a dual-stack listener finds the same connection.
  EXPECT_EQ(
      ConnectionEnds::Get().ServerEndOf("ipv6:%5B::ffff:" + uri.substr(5, uri.rfind(':') - 5) +
                                        "%5D" + uri.substr(uri.rfind(':'))),
      end);
  EXPECT_EQ(*end, "ipv4:127.0.0.1:" + std::to_string(ntohs(server.at.sin_port)));
  EXPECT_EQ(SocketOwnerOf(uri, *end), ::geteuid()) << uri;
  ::close(client);
  ConnectionEnds::Get().Remove(accepted);
  ::close(accepted);
  EXPECT_EQ(ConnectionEnds::Get().ServerEndOf(uri), std::nullopt);
}

// The review of issue 67's bypass: a client bound where another client is (SO_REUSEADDR), connected
// to another of this host's addresses, then gone from the table before its call was looked up, was
// taken for the other's owner. Two open connections with one client end: ServerEndOf knows
// neither; a client end whose socket its process no longer holds: no owner.
TEST(PeerTest, TwoConnectionsFromOneClientEndAreNotTakenForEachOther) {
  const Loopback first("127.0.0.1"), second("127.0.0.2");
  const auto [a, a_accepted] = first.Connect();
  sockaddr_in where{};
  socklen_t len = sizeof where;
  ::getsockname(a, reinterpret_cast<sockaddr*>(&where), &len);
  const auto [b, b_accepted] = second.Connect(&where);  // The same client end.
  ASSERT_GE(b_accepted, 0);
  const std::string uri = ClientUri(b_accepted);
  EXPECT_EQ(uri, ClientUri(a_accepted));
  EXPECT_TRUE(ConnectionEnds::Get().Add(a_accepted));
  EXPECT_FALSE(ConnectionEnds::Get().Add(b_accepted));  // A listener that can refuses it.
  EXPECT_EQ(ConnectionEnds::Get().ServerEndOf(uri), std::nullopt);
  ConnectionEnds::Get().Remove(a_accepted);
  const std::optional<std::string> end = ConnectionEnds::Get().ServerEndOf(uri);
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->rfind("ipv4:127.0.0.2:", 0), 0u) << *end;
  EXPECT_EQ(SocketOwnerOf(uri, *end), ::geteuid());
  ::close(b);  // Orphaned (FIN_WAIT): no process holds it now.
  EXPECT_EQ(SocketOwnerOf(uri, *end), std::nullopt);
  ConnectionEnds::Get().Remove(b_accepted);
  for (int fd : {a, a_accepted, b_accepted}) ::close(fd);
}

}  // namespace
}  // namespace attnserve
