#pragma once

#include <chrono>
#include <cstdint>
#include <map>

namespace attnserve {

/// Closes a stopping server's client connections the way web servers do ("lingering close"), so
/// that an answer still travelling is never reset on its way.
///
/// gRPC 1.51 closes a connection as soon as its last call has ended once the server is stopping
/// (and attnserve closes idle ones itself). It shuts the socket down both ways, then closes it,
/// while the end of an answer may still be unread by the client (in a proxy's or the client's
/// kernel, or on the way). Any byte the client sends after that (it acknowledges what it reads
/// with flow-control updates) makes the kernel reset the connection, and a reset throws away what
/// the client had not read yet. Here, a held connection is shut down for sending only (the answer,
/// then the end of the stream, still go out as written), gRPC's close leaves it open (a second
/// descriptor is held), and it is closed once its client has read everything: the client has
/// closed its end (a client reads the end of the stream after the answer), or it has acknowledged
/// every byte and been quiet for long enough (a client reading what its kernel holds sends
/// flow-control updates as it goes). The client's receive window is not used: a kernel may
/// advertise a narrower one with nothing unread (seen once behind nginx: a 27 s stop).
///
/// Linux (reads /proc/self/fd and TCP_INFO; TCP connections only). The executable must define and
/// export the `shutdown` of process/interposers.cc (CMake's attnserve_interposers, linked into
/// `attnserve`); without it, connections close as gRPC closes them. Not thread-safe: one stopping
/// thread.
class SocketLinger {
 public:
  /// How long a connection that has been sent nothing but gRPC's goodbye (GOAWAY, PING: under
  /// kGoodbyeBytes) since it was held must stay quiet before it is closed: a flow-control update
  /// on its way would otherwise meet a closed socket.
  static constexpr std::chrono::milliseconds kIdleQuiet{20};
  /// How long one that carried more (an answer) must stay quiet, every byte acknowledged, when its
  /// client does not close its end: a client that reads slowly may still hold part of the answer
  /// unread in its kernel.
  static constexpr std::chrono::milliseconds kAnsweredQuiet{1000};
  static constexpr uint64_t kGoodbyeBytes = 2048;
  /// A connection whose every byte has been acknowledged this long is closed even if its client
  /// keeps sending and does not close: a client reading a slow answer stops sending once it has
  /// it all, one that sends on regardless would hold the stop to the end of the grace period.
  static constexpr std::chrono::milliseconds kAcknowledgedLinger{1500};

  SocketLinger() = default;
  SocketLinger(const SocketLinger&) = delete;
  SocketLinger& operator=(const SocketLinger&) = delete;
  /// Closes whatever is still held.
  ~SocketLinger();

  /// Holds every connected TCP socket of this process whose local port is `port` (the server's
  /// accepted connections; the listener is left alone) that is not held yet. Call it before the
  /// server starts to close connections and again while it stops, to catch connections accepted
  /// meanwhile. Returns how many are held in all.
  int HoldConnectionsOn(int port);

  /// Once the server has closed its connections: waits until each held one is read (as above) or
  /// until `deadline`, and closes it. Returns how many were closed at the deadline with bytes their
  /// clients had not yet acknowledged.
  int CloseWhenRead(std::chrono::steady_clock::time_point deadline);

  /// True when this process's `shutdown` is attnserve's (lingering close in effect).
  static bool Installed();
  /// Whether `fd` is a connection held here: attnserve's `shutdown` then shuts it for sending only.
  /// Thread-safe.
  static bool Holds(int fd);

 private:
  struct Held {
    int fd = -1;                // Our descriptor for the connection.
    uint64_t sent_at_hold = 0;  // Bytes acknowledged or in flight when it was held.
    std::chrono::steady_clock::time_point heard;  // When the client last sent or read anything.
    std::chrono::steady_clock::time_point acknowledged{};  // Since when every byte is (or never).
  };
  // kDone: closed by the client, or read and quiet (or acknowledged for kAcknowledgedLinger);
  // kQuieting: read, not quiet yet; kUnread.
  enum class State { kDone, kQuieting, kUnread };
  static State Look(Held& held, std::chrono::steady_clock::time_point now);

  std::map<unsigned long, Held> held_;  // by socket inode
};

}  // namespace attnserve
