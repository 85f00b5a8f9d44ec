// SocketLinger over real loopback TCP connections: the server side fills the client's buffers, then
// is shut down and closed the way gRPC closes a connection (shutdown both ways, close), while the
// client has not read yet and sends a byte (as a flow-control update does).
#include "server/process/socket_linger.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <thread>
#include <vector>

namespace attnserve {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// A listener on 127.0.0.1, one client connected to it and the server's end of that connection.
struct Connection {
  int listener = -1, client = -1, server = -1, port = 0;

  Connection() {
    listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(address);
    EXPECT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), len), 0);
    EXPECT_EQ(listen(listener, 4), 0);
    EXPECT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&address), &len), 0);
    port = ntohs(address.sin_port);
    client = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&address), len), 0);
    server = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    EXPECT_GE(server, 0);
  }
  ~Connection() {
    for (int fd : {listener, client, server}) {
      if (fd >= 0) close(fd);
    }
  }

  // Writes from the server until the client's buffers and the server's are full; returns the bytes.
  size_t FillFromServer() {
    fcntl(server, F_SETFL, fcntl(server, F_GETFL) | O_NONBLOCK);
    std::vector<char> chunk(64 << 10, 'a');
    size_t sent = 0;
    bool waited = false;
    for (;;) {
      const ssize_t n = send(server, chunk.data(), chunk.size(), MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
        continue;
      }
      // Full for now; the kernel may still take a little more once the client acknowledges.
      if (n < 0 && errno == EAGAIN && !waited) {
        waited = true;
        std::this_thread::sleep_for(50ms);
        continue;
      }
      return sent;
    }
  }

  // What gRPC does to a connection it is done with.
  void CloseServerAsGrpcDoes() {
    shutdown(server, SHUT_RDWR);
    close(server);
    server = -1;
  }

  // The client's flow-control update: a byte to a server that has closed.
  void ClientSendsAByte() {
    ASSERT_EQ(send(client, "u", 1, MSG_NOSIGNAL), 1);
    std::this_thread::sleep_for(50ms);  // Arrived, and answered (by a reset, without the linger).
  }

  // Reads until the end of the stream or an error; the bytes read and errno (0 at a clean end).
  std::pair<size_t, int> ClientReadsAll() {
    std::vector<char> buffer(64 << 10);
    size_t got = 0;
    for (;;) {
      const ssize_t n = recv(client, buffer.data(), buffer.size(), 0);
      if (n > 0) {
        got += static_cast<size_t>(n);
      } else if (n == 0) {
        return {got, 0};
      } else if (errno != EINTR) {
        return {got, errno};
      }
    }
  }
};

TEST(SocketLingerTest, TheInterposedShutdownIsInEffect) { EXPECT_TRUE(SocketLinger::Installed()); }

// Without the linger, the mechanism this guards against: the client's byte meets a closed socket,
// the kernel resets the connection and the client loses what it had not read yet.
TEST(SocketLingerTest, WithoutItTheClientLosesTheUnreadAnswer) {
  Connection c;
  const size_t sent = c.FillFromServer();
  ASSERT_GT(sent, 0u);
  c.CloseServerAsGrpcDoes();
  c.ClientSendsAByte();
  const auto [got, error] = c.ClientReadsAll();
  EXPECT_LT(got, sent);
  EXPECT_EQ(error, ECONNRESET);
}

// As in a stopping server: the connection is held, then the answer is written.
TEST(SocketLingerTest, AHeldConnectionIsReadWholeThenClosed) {
  Connection c;
  SocketLinger linger;
  EXPECT_EQ(linger.HoldConnectionsOn(c.port), 1);  // The connection, not the listener.
  const size_t sent = c.FillFromServer();
  c.CloseServerAsGrpcDoes();
  c.ClientSendsAByte();
  auto closed = std::async(std::launch::async,
                           [&linger] { return linger.CloseWhenRead(Clock::now() + 20s); });
  const auto [got, error] = c.ClientReadsAll();
  EXPECT_EQ(got, sent);
  EXPECT_EQ(error, 0) << "the client reads the end of the stream after the answer";
  close(c.client);  // The client closes its end once it has everything...
  c.client = -1;
  ASSERT_EQ(closed.wait_for(5s), std::future_status::ready);  // ... and the server's end goes.
  EXPECT_EQ(closed.get(), 0);
}

TEST(SocketLingerTest, AClientThatReadsEverythingButKeepsItsEndIsClosedOnceQuiet) {
  Connection c;
  SocketLinger linger;
  linger.HoldConnectionsOn(c.port);
  const size_t sent = c.FillFromServer();
  c.CloseServerAsGrpcDoes();
  const auto start = Clock::now();
  auto closed = std::async(std::launch::async,
                           [&linger] { return linger.CloseWhenRead(Clock::now() + 20s); });
  EXPECT_EQ(c.ClientReadsAll(), std::make_pair(sent, 0));
  ASSERT_EQ(closed.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(closed.get(), 0);
  EXPECT_GE(Clock::now() - start, SocketLinger::kAnsweredQuiet);  // It carried an answer.
}

TEST(SocketLingerTest, AnIdleConnectionIsClosedAtOnce) {
  Connection c;
  SocketLinger linger;
  EXPECT_EQ(linger.HoldConnectionsOn(c.port), 1);
  c.CloseServerAsGrpcDoes();
  const auto start = Clock::now();
  EXPECT_EQ(linger.CloseWhenRead(start + 20s), 0);
  EXPECT_LT(Clock::now() - start, SocketLinger::kAnsweredQuiet);
  EXPECT_EQ(c.ClientReadsAll(), std::make_pair(size_t{0}, 0));
}

TEST(SocketLingerTest, AClientThatNeverReadsIsClosedAtTheDeadlineAndCounted) {
  Connection c;
  SocketLinger linger;
  linger.HoldConnectionsOn(c.port);
  c.FillFromServer();
  c.CloseServerAsGrpcDoes();
  const auto start = Clock::now();
  EXPECT_EQ(linger.CloseWhenRead(start + 300ms), 1);  // Its full buffer leaves bytes unsent.
  EXPECT_LT(Clock::now() - start, 3s);
}

// An answer that fits in the client's buffer is acknowledged at once by its kernel: a client that
// neither reads nor closes keeps the connection for kAnsweredQuiet, then it is closed without a
// reset (the client sent nothing more), so the client still reads it whole.
TEST(SocketLingerTest, AnAcknowledgedAnswerIsKeptForTheQuietPeriodAndClosedCleanly) {
  Connection c;
  SocketLinger linger;
  linger.HoldConnectionsOn(c.port);
  const std::vector<char> answer(64 << 10, 'a');
  ASSERT_EQ(send(c.server, answer.data(), answer.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(answer.size()));
  c.CloseServerAsGrpcDoes();
  const auto start = Clock::now();
  EXPECT_EQ(linger.CloseWhenRead(start + SocketLinger::kAnsweredQuiet + 2s), 0);
  EXPECT_GE(Clock::now() - start, SocketLinger::kAnsweredQuiet);
  EXPECT_LT(Clock::now() - start, SocketLinger::kAnsweredQuiet + 2s);
  EXPECT_EQ(c.ClientReadsAll(), std::make_pair(answer.size(), 0));  // Closed without a reset.
}

// A client that keeps sending after the end of the stream, and never closes, does not hold the stop
// to its deadline once everything sent to it is acknowledged.
TEST(SocketLingerTest, AClientThatSendsOnAndNeverClosesIsClosedAfterTheAcknowledgedLinger) {
  Connection c;
  SocketLinger linger;
  linger.HoldConnectionsOn(c.port);
  c.CloseServerAsGrpcDoes();
  std::atomic<bool> done{false};
  // The longest pause between two of the client's sends while the stop ran: a client starved of
  // CPU for longer than SocketLinger::kIdleQuiet is a quiet one, rightly closed early.
  Clock::duration longest_pause{};
  std::thread sender([&] {
    auto last = Clock::now();
    while (!done && send(c.client, "u", 1, MSG_NOSIGNAL) == 1) {
      const auto now = Clock::now();
      longest_pause = std::max(longest_pause, now - last);
      last = now;
      std::this_thread::sleep_for(2ms);
    }
  });
  const auto start = Clock::now();
  EXPECT_EQ(linger.CloseWhenRead(start + 20s), 0);
  const auto took = Clock::now() - start;
  done = true;
  sender.join();
  if (longest_pause < SocketLinger::kIdleQuiet) {
    EXPECT_GE(took, SocketLinger::kAcknowledgedLinger) << "closed while its client kept sending";
  } else {
    std::printf("the client paused %.0f ms (starved): its early close is not checked\n",
                std::chrono::duration<double, std::milli>(longest_pause).count());
  }
  EXPECT_LT(took, SocketLinger::kAcknowledgedLinger + 2s);
}

TEST(SocketLingerTest, OtherSocketsAreShutAsAsked) {
  Connection c;  // Not held: shutdown both ways, so the server reads the end at once.
  ASSERT_EQ(shutdown(c.server, SHUT_RDWR), 0);
  char byte;
  EXPECT_EQ(recv(c.server, &byte, 1, MSG_DONTWAIT), 0);
}

}  // namespace
}  // namespace attnserve
