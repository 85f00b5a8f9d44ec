#pragma once
// The bounds on gRPC's listeners and their connections that gRPC 1.51 does not keep itself, kept in
// the system calls it makes (process/interposers.cc: accept4, recvmsg, sendmsg, close): connections
// in all and per peer address, an accept loop that never stops on a full descriptor table
// (CVE-2023-4785), and on plaintext connections the HTTP/2 inspector's bounds (streams, header
// blocks, messages announced, resets) plus each peer's streams and incomplete uploads
// (docs/grpc-workarounds.md, docs/flags.md "Transport").

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "server/core/peer.h"
#include "server/process/h2_inspector.h"

namespace attnserve {

/// One listener's bounds; a flag each (docs/flags.md "Transport").
struct ConnectionLimits {
  /// Connections open at once (--max-connections); the server lowers it to what its descriptors
  /// allow. When full, a new connection is taken by shutting the least recently active one (the
  /// one that sent no call nor message bytes for longest), unless an eighth are on their way out
  /// already: then it is closed as soon as it is accepted. A peer is an IPv4 address or an IPv6
  /// /64.
  int64_t max_connections = 4096;
  /// Connections open at once from one peer address (--max-connections-per-peer).
  int64_t max_connections_per_peer = 256;
  /// Streams open at once from one peer address, over its connections (--max-streams-per-peer):
  /// a stream gRPC holds costs ~12 KB before its request arrives.
  int64_t max_streams_per_peer = 4096;
  /// Streams open at once on the listener, over all its connections (--max-streams). When it is
  /// full, the least recently active connection holding a stream is shut for a new one.
  int64_t max_streams = 16384;
  /// Bytes of messages not yet whole on the listener (--max-upload-bytes; 0: no bound of its own).
  /// When full, the least recently active connection holding some is shut (gRPC's resource quota
  /// would cancel a stream at random). The server sets it to what the quota leaves after the
  /// requests in flight.
  int64_t max_partial_bytes = 0;
  /// Bytes of messages not yet whole from one peer address (--max-upload-bytes-per-peer; 0: no
  /// bound of its own). The server sets it to the memory plan's messages arriving at once
  /// (kArrivingMessages of --max-message-bytes).
  int64_t max_partial_bytes_per_peer = 0;
  /// The HTTP/2 bounds of each plaintext connection.
  H2Limits h2;
};

/// What the guard has counted, for /metrics.
struct GuardCounts {
  int64_t connections = 0;    ///< Open on guarded listeners.
  int64_t streams = 0;        ///< Open on plaintext guarded connections.
  int64_t partial_bytes = 0;  ///< Bytes of messages not yet whole on them.
  /// Connections closed as accepted, by reason: max_connections, peer_connections, fd_limit.
  std::map<std::string, int64_t> refused;
  /// Connections closed for what their client sent, by reason: streams, peer_streams,
  /// listener_streams, peer_uploads, uploads, settings, the *_pushed_out ones (shut to make room
  /// for another peer's: max_connections_pushed_out, listener_streams_pushed_out,
  /// uploads_pushed_out), header_bytes, header_frames, header_timeout, message_bytes, resets.
  std::map<std::string, int64_t> closed;
};

/// The process's one guard. Thread-safe: every gRPC thread's system calls pass through it.
class ConnectionGuard {
 public:
  static ConnectionGuard& Get();

  /// The key a Unix domain socket listener at `path` is guarded under (negative: no port's).
  static int UnixKey(const std::string& path);
  /// Guards the gRPC listener bound to `port` (or UnixKey) from now on; `plaintext` connections are
  /// also read by the HTTP/2 inspector. `name` labels its log lines. Replaces an earlier guard of
  /// the port.
  void Guard(int port, const std::string& name, const ConnectionLimits& limits, bool plaintext);
  /// Stops counting new connections on `port` (those open keep their accounts until closed).
  void Unguard(int port);
  /// Connections accepted on `port` since it was guarded (refused ones included): an accept loop
  /// that still runs counts up.
  int64_t accepted(int port) const;
  GuardCounts counts() const;
  /// True when this process's system calls reach the guard (process/interposers.cc is linked).
  static bool Installed();

  // The interposers' hooks, each after (or around) the C library's own call.
  /// accept4 on any listening socket of the process: on a full descriptor table the waiting
  /// connection is accepted and closed (a descriptor kept spare for it) and the call says EAGAIN
  /// when none is left, so that gRPC's accept loop never stops; a guarded listener's connection
  /// over a bound is closed at once and the next one taken.
  int Accept(int listener, sockaddr* addr, socklen_t* len, int flags);
  /// recvmsg returned `n` bytes into `msg`: read by the connection's inspector. -1 (ECONNRESET)
  /// when its client broke a bound: the connection is shut down.
  ssize_t Received(int fd, const msghdr* msg, ssize_t n);
  /// sendmsg wrote the first `n` bytes of `msg`.
  void Sent(int fd, const msghdr* msg, ssize_t n);
  /// `fd` is being closed.
  void Closing(int fd);

  struct Listener;
  struct Connection;

 private:
  ConnectionGuard();
  std::shared_ptr<Listener> ListenerOf(int listener_fd) const;
  std::shared_ptr<Connection> Find(int fd) const;
  bool ShedOne(int listener, int flags);
  void Break(int fd, Connection& c, const H2Breach& breach);
  // Every second, while a listener is guarded: connections whose header block's time ran out
  // while their client sent nothing more are shut.
  void Sweep();

  mutable std::mutex listeners_mu_;
  std::map<int, std::shared_ptr<Listener>> listeners_;  // by port
  mutable std::shared_mutex conns_mu_;
  std::unordered_map<int, std::shared_ptr<Connection>> conns_;  // by descriptor
  std::atomic<int64_t> tracked_{0};                             // conns_.size()
  std::mutex spare_mu_;
  int spare_fd_ = -1;  // Closed to accept (and close) one connection when descriptors run out.
  std::atomic<int64_t> fd_limit_refused_{0};
  std::once_flag sweeper_;
};

}  // namespace attnserve
