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
    const int fd = accept4(listener, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
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

TEST(ConnectionGuardTest, ConnectionsPastTheBoundsAreClosedAsAcceptedAndTheRestCounted) {
  ASSERT_TRUE(ConnectionGuard::Installed());
  Listening l;
  ConnectionLimits limits;
  limits.max_connections = 3;
  limits.max_connections_per_peer = 2;
  ConnectionGuard::Get().Guard(l.port, "test", limits, true);
  const int64_t peer_before = Refused("peer_connections"), all_before = Refused("max_connections");
  std::vector<int> clients = {Connect(l.port), Connect(l.port), Connect(l.port), Connect(l.port, "127.0.0.2"),
                              Connect(l.port, "127.0.0.2")};
  usleep(50000);
  std::vector<int> accepted = AcceptAll(l.fd);
  EXPECT_EQ(accepted.size(), 3u);  // Two from 127.0.0.1, one from 127.0.0.2: three in all.
  EXPECT_EQ(Refused("peer_connections") - peer_before, 1);
  EXPECT_EQ(Refused("max_connections") - all_before, 1);
  EXPECT_EQ(ConnectionGuard::Get().accepted(l.port), 5);
  const int64_t open = ConnectionGuard::Get().counts().connections;
  close(accepted.back());  // gRPC's close: the connection's place is free again.
  EXPECT_EQ(ConnectionGuard::Get().counts().connections, open - 1);
  clients.push_back(Connect(l.port, "127.0.0.2"));
  usleep(50000);
  std::vector<int> again = AcceptAll(l.fd);
  EXPECT_EQ(again.size(), 1u);
  for (int fd : clients) close(fd);
  for (size_t i = 0; i + 1 < accepted.size(); ++i) close(accepted[i]);
  for (int fd : again) close(fd);
}

TEST(ConnectionGuardTest, AFullDescriptorTableShedsConnectionsAndTheLoopGoesOn) {
  Listening l;  // Not guarded: the descriptor table's bound holds for every listener of the process.
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
  std::string bytes = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  for (uint32_t id = 1; id <= 11; id += 2) {  // Six HEADERS-only streams: past twice 2.
    bytes += std::string("\0\0\0\x01\x04\0\0\0", 8) + static_cast<char>(id);
  }
  ASSERT_EQ(write(client, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  usleep(50000);
  char buffer[4096];
  iovec iov{buffer, sizeof buffer};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  EXPECT_EQ(recvmsg(accepted[0], &msg, 0), -1);
  EXPECT_EQ(errno, ECONNRESET);
  EXPECT_EQ(read(client, buffer, sizeof buffer), 0) << "the connection is shut";
  EXPECT_GE(ConnectionGuard::Get().counts().closed.at("streams"), 1);
  close(accepted[0]);
  close(client);
}

}  // namespace
}  // namespace attnserve
