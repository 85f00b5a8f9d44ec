// The connection guard through this process's own accept4, recvmsg and close (the test binary links
// process/interposers.cc): listeners of its own on loopback, clients from 127.0.0.1 and 127.0.0.2.
#include "server/process/connection_guard.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace attnserve {
namespace {

struct Listening {
  int fd = -1, port = 0;
  Listening() {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(listen(fd, 64), 0);
    socklen_t n = sizeof a;
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
    port = ntohs(a.sin_port);
  }
  ~Listening() {
    ConnectionGuard::Get().Unguard(port);
    close(fd);
  }
};

int Connect(int port, const char* from = "127.0.0.1") {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, from, &a.sin_addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

// What gRPC's accept loop does: accept until EAGAIN; the descriptors accepted.
std::vector<int> AcceptAll(int listener) {
  std::vector<int> fds;
  for (;;) {
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    const int fd =
        accept4(listener, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      EXPECT_EQ(errno, EAGAIN) << "gRPC 1.51's loop stops for good on any other error";
      return fds;
    }
    fds.push_back(fd);
  }
}

int64_t Refused(const char* reason) {
  const GuardCounts c = ConnectionGuard::Get().counts();
  const auto it = c.refused.find(reason);
  return it == c.refused.end() ? 0 : it->second;
}

TEST(ConnectionGuardTest, ConnectionsPastTheirPeersBoundAreClosedAsAcceptedAndTheRestCounted) {
  ASSERT_TRUE(ConnectionGuard::Installed());
  Listening l;
  ConnectionLimits limits;
  limits.max_connections_per_peer = 2;
  ConnectionGuard::Get().Guard(l.port, "test", limits, true);
  const int64_t peer_before = Refused("peer_connections");
  std::vector<int> clients = {Connect(l.port), Connect(l.port), Connect(l.port),
                              Connect(l.port, "127.0.0.2"), Connect(l.port, "127.0.0.2")};
  usleep(50000);
  std::vector<int> accepted = AcceptAll(l.fd);
  EXPECT_EQ(accepted.size(), 4u);  // Two from 127.0.0.1, two from 127.0.0.2.
  EXPECT_EQ(Refused("peer_connections") - peer_before, 1);
  EXPECT_EQ(ConnectionGuard::Get().accepted(l.port), 5);
  const int64_t open = ConnectionGuard::Get().counts().connections;
  close(accepted.front());  // gRPC's close: the connection's place is free again.
  EXPECT_EQ(ConnectionGuard::Get().counts().connections, open - 1);
  clients.push_back(Connect(l.port));
  usleep(50000);
  std::vector<int> again = AcceptAll(l.fd);
  EXPECT_EQ(again.size(), 1u);
  for (int fd : clients) close(fd);
  for (size_t i = 1; i < accepted.size(); ++i) close(accepted[i]);
  for (int fd : again) close(fd);
}

int64_t Closed(const char* reason) {
  const GuardCounts c = ConnectionGuard::Get().counts();
  const auto it = c.closed.find(reason);
  return it == c.closed.end() ? 0 : it->second;
}

// Whether the server shut `client`'s connection (it reads the end, or a reset).
bool Shut(int client) {
  char b[256];
  timeval wait{2, 0};
  setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  for (;;) {
    const ssize_t n = read(client, b, sizeof b);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    if (n < 0) return false;
  }
}

// Reads what `fd`'s client sent through this process's recvmsg (the guard's inspector sees it).
ssize_t Receive(int fd) {
  char buffer[4096];
  iovec iov{buffer, sizeof buffer};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  return recvmsg(fd, &msg, 0);
}

std::string Headers(uint32_t first, int n) {
  std::string bytes;
  for (int i = 0; i < n; ++i) {
    bytes += std::string("\0\0\0\x01\x04\0\0\0", 8) + static_cast<char>(first + 2 * i);
  }
  return bytes;
}

// A full listener takes a new connection by shutting its least recently active one (idle holders
// first: an attacker's connections left open are the oldest); past an eighth of the listener on
// their way out at once, it refuses instead.
TEST(ConnectionGuardTest, AFullListenerMakesRoomByShuttingItsIdlestConnection) {
  Listening l;
  ConnectionLimits limits;
  limits.max_connections = 4;
  ConnectionGuard::Get().Guard(l.port, "test", limits, true);
  const int64_t before = Closed("max_connections_pushed_out");
  std::vector<int> greedy;
  for (int i = 0; i < 4; ++i) greedy.push_back(Connect(l.port));
  usleep(50000);
  std::vector<int> accepted = AcceptAll(l.fd);
  ASSERT_EQ(accepted.size(), 4u);
  const int other = Connect(l.port, "127.0.0.2");
  usleep(50000);
  std::vector<int> more = AcceptAll(l.fd);
  EXPECT_EQ(more.size(), 1u) << "another peer's connection is taken: the idlest makes room";
  EXPECT_EQ(Closed("max_connections_pushed_out") - before, 1);
  EXPECT_TRUE(Shut(greedy.front())) << "the first accepted has been idle longest";
  const int64_t refused_before = Refused("max_connections");
  const int another = Connect(l.port, "127.0.0.2");  // The shut one is not closed yet, and an
  usleep(50000);                                     // eighth of 4 (at least 1) is on its way out.
  EXPECT_TRUE(AcceptAll(l.fd).empty());
  EXPECT_EQ(Refused("max_connections") - refused_before, 1);
  close(another);
  for (int fd : accepted) close(fd);  // gRPC closes the one shut: its place is free again.
  for (int fd : more) close(fd);
  for (int fd : greedy) close(fd);
  close(other);
}

TEST(ConnectionGuardTest, AFullListenerOfStreamsMakesRoomFromTheIdlestConnectionHoldingOne) {
  Listening l;
  ConnectionLimits limits;
  limits.max_streams = 4;
  ConnectionGuard::Get().Guard(l.port, "test", limits, true);
  const int64_t before = Closed("listener_streams_pushed_out");
  const int greedy = Connect(l.port), other = Connect(l.port, "127.0.0.2");
  usleep(50000);
  std::vector<int> accepted = AcceptAll(l.fd);
  ASSERT_EQ(accepted.size(), 2u);
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  const std::string four = preface + Headers(1, 4);
  ASSERT_EQ(write(greedy, four.data(), four.size()), static_cast<ssize_t>(four.size()));
  const std::string one = preface + Headers(1, 1);
  ASSERT_EQ(write(other, one.data(), one.size()), static_cast<ssize_t>(one.size()));
  usleep(50000);
  // Which accepted descriptor is whose: the first has the greedy client's bytes (it connected
  // first).
  EXPECT_GT(Receive(accepted[0]), 0);
  EXPECT_EQ(ConnectionGuard::Get().counts().streams, 4);
  EXPECT_GT(Receive(accepted[1]), 0) << "the other peer's stream is taken";
  EXPECT_EQ(Closed("listener_streams_pushed_out") - before, 1);
  EXPECT_TRUE(Shut(greedy));
  for (int fd : accepted) close(fd);
  close(greedy);
  close(other);
}

TEST(ConnectionGuardTest, AFullDescriptorTableShedsConnectionsAndTheLoopGoesOn) {
  Listening
      l;  // Not guarded: the descriptor table's bound holds for every listener of the process.
  std::vector<int> clients = {Connect(l.port), Connect(l.port), Connect(l.port)};
  usleep(50000);
  rlimit before{};
  getrlimit(RLIMIT_NOFILE, &before);
  rlimit low = before;
  low.rlim_cur = 256;  // Above every descriptor open now (the guard's spare among them).
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;
  for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) filler.push_back(fd);
  ASSERT_EQ(errno, EMFILE);
  const int64_t shed_before = Refused("fd_limit");
  EXPECT_TRUE(AcceptAll(l.fd).empty());  // EAGAIN, never EMFILE.
  EXPECT_EQ(Refused("fd_limit") - shed_before, 3);
  for (int fd : filler) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
  clients.push_back(Connect(l.port));
  usleep(50000);
  const std::vector<int> later = AcceptAll(l.fd);
  EXPECT_EQ(later.size(), 1u) << "the listener takes connections again";
  for (int fd : later) close(fd);
  for (int fd : clients) close(fd);
}

TEST(ConnectionGuardTest, AClientThatBreaksABoundHasItsReadFailAndItsConnectionShut) {
  Listening l;
  ConnectionLimits limits;
  limits.h2.max_concurrent_streams = 2;
  ConnectionGuard::Get().Guard(l.port, "test", limits, true);
  const int client = Connect(l.port);
  usleep(50000);
  std::vector<int> accepted = AcceptAll(l.fd);
  ASSERT_EQ(accepted.size(), 1u);
  const std::string bytes = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + Headers(1, 6);  // Past twice 2.
  ASSERT_EQ(write(client, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  usleep(50000);
  EXPECT_EQ(Receive(accepted[0]), -1);
  EXPECT_EQ(errno, ECONNRESET);
  EXPECT_TRUE(Shut(client)) << "the connection is shut";
  EXPECT_GE(ConnectionGuard::Get().counts().closed.at("streams"), 1);
  close(accepted[0]);
  close(client);
}

}  // namespace
}  // namespace attnserve
