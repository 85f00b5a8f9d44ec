#include "server/process/connection_guard.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <set>
#include <thread>
#include <vector>

#include "server/core/peer.h"

namespace attnserve {

struct ConnectionGuard::Listener {
  int port = 0;
  std::string name;
  ConnectionLimits limits;
  bool plaintext = false;
  std::atomic<int64_t> accepted{0};

  struct Peer {
    int64_t connections = 0, streams = 0, partial = 0;
    std::set<Connection*> open;  // Its connections whose descriptors are not closed yet.
  };
  std::mutex mu;  // Everything below.
  int64_t connections = 0, streams = 0, partial = 0;
  // Shut to make room and not closed yet: their connections, and the streams and bytes they held
  // then, which the bounds no longer count against others.
  int64_t evicting = 0, evicting_streams = 0, evicting_partial = 0;
  std::unordered_map<std::string, Peer> peers;
  std::map<std::string, int64_t> refused, closed;
  std::map<std::string, std::chrono::steady_clock::time_point> logged;  // by reason

  // Under mu: says the first time in 10 s that `reason` cut a peer off (the rest are counted in
  // `series`).
  void Log(const std::string& reason, const std::string& peer, const std::string& detail,
           const char* series) {
    const auto now = std::chrono::steady_clock::now();
    auto [it, first] = logged.emplace(reason, now);
    if (!first && now - it->second < std::chrono::seconds(10)) return;
    it->second = now;
    std::cerr << "attnserve: " << name << " connection from " << peer << " closed: " << detail
              << " (in 10 s, further ones only count in " << series << "{reason=\"" << reason
              << "\"})" << std::endl;
  }
  void Forget(const std::string& peer) {  // Under mu: a peer with nothing open is not kept.
    const auto it = peers.find(peer);
    if (it != peers.end() && it->second.connections == 0 && it->second.streams == 0 &&
        it->second.partial == 0 && it->second.open.empty()) {
      peers.erase(it);
    }
  }
  // Under mu: shuts the connection, other than `keep`, that received a call or a message's bytes
  // least recently among those holding any of `what` (streams, partial; null: connections), to
  // make room for another's, counted as `reason`. Idle holders go first: an attacker's streams
  // and uploads left open are the oldest, a client sending calls is fresh. False when none is left.
  bool Evict(const Connection* keep, int64_t Connection::*what, const char* reason);
  // Under mu: a connection shut by Evict is closing; what it held stops being discounted.
  void Evicted(Connection& c);
};

/// One guarded connection: its peer's accounts, and on plaintext its inspector.
struct ConnectionGuard::Connection final : StreamAccount {
  std::shared_ptr<Listener> listener;
  std::string peer;
  int fd = -1;
  std::mutex mu;  // The inspector: a connection's reads and writes run on different threads.
  std::unique_ptr<H2Inspector> h2;
  bool broken = false;
  // Under listener->mu: its streams and bytes of messages not yet whole, and whether it was shut
  // to make room, with what it held then (its descriptor open until gRPC closes it: Closing takes
  // it out of its peer's `open` first, under the same lock).
  int64_t streams = 0, partial = 0;
  bool evicted = false;
  int64_t evicted_streams = 0, evicted_partial = 0;
  // When it last received a call or a message's bytes (steady clock, ns): Evict's order. Until its
  // first call, its acceptance less kNeverActive: a connection that sent nothing yet is shut before
  // any that did (a flood's new connections are not fresher than a client at work), the oldest
  // first.
  static constexpr int64_t kNeverActive = int64_t{1} << 50;
  std::atomic<int64_t> active{std::chrono::steady_clock::now().time_since_epoch().count() -
                              kNeverActive};

  void Active() override {
    active.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                 std::memory_order_relaxed);
  }

  ~Connection() override {
    h2.reset();  // Gives its streams and incomplete messages back first.
    std::lock_guard<std::mutex> lock(listener->mu);
    --listener->connections;
    Listener::Peer& p = listener->peers[peer];
    --p.connections;
    if (p.open.erase(this) > 0) listener->Evicted(*this);
    listener->Forget(peer);
  }
  H2Breach OpenStream() override {
    Listener& l = *listener;
    std::lock_guard<std::mutex> lock(l.mu);
    Listener::Peer& p = l.peers[peer];
    if (p.streams >= l.limits.max_streams_per_peer) {
      return {"peer_streams", "its peer has " + std::to_string(p.streams) +
                                  " streams open, the most one peer address may "
                                  "(--max-streams-per-peer)"};
    }
    if (l.streams - l.evicting_streams >= l.limits.max_streams &&
        !l.Evict(this, &Connection::streams, "listener_streams")) {
      // The listener is full and no other connection holds a stream to make room with.
      return {"listener_streams",
              "the listener has " + std::to_string(l.streams) + " streams open, its --max-streams"};
    }
    ++p.streams;
    ++l.streams;
    ++streams;
    return {};
  }
  void CloseStream() override {
    std::lock_guard<std::mutex> lock(listener->mu);
    --listener->peers[peer].streams;
    --listener->streams;
    --streams;
  }
  H2Breach AddPartial(int64_t bytes) override {
    Listener& l = *listener;
    std::lock_guard<std::mutex> lock(l.mu);
    Listener::Peer& p = l.peers[peer];
    const int64_t cap = l.limits.max_partial_bytes_per_peer;
    if (cap > 0 && p.partial + bytes > cap) {
      return {"peer_uploads", "its peer's messages not yet whole would hold over " +
                                  std::to_string(cap) + " bytes (--max-upload-bytes-per-peer)"};
    }
    const int64_t all = l.limits.max_partial_bytes;
    // The listener's uploads full: the idlest uploader makes room (gRPC's own reclaimer would
    // cancel a stream at random instead).
    if (all > 0 && l.partial - l.evicting_partial + bytes > all &&
        !l.Evict(this, &Connection::partial, "uploads")) {
      return {"uploads", "the listener's messages not yet whole would hold over " +
                             std::to_string(all) + " bytes (--max-upload-bytes)"};
    }
    p.partial += bytes;
    l.partial += bytes;
    partial += bytes;
    return {};
  }
  void RemovePartial(int64_t bytes) override {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(listener->mu);
    listener->peers[peer].partial -= bytes;
    listener->partial -= bytes;
    partial -= bytes;
  }
};

bool ConnectionGuard::Listener::Evict(const Connection* keep, int64_t Connection::*what,
                                      const char* reason) {
  // Shut connections hold their descriptors until gRPC closes them: at most an eighth of the
  // listener's are on their way out at once, whatever the rate of arrivals.
  if (evicting >= std::max<int64_t>(1, limits.max_connections / 8)) return false;
  Connection* victim = nullptr;
  for (auto& [address, p] : peers) {
    for (Connection* c : p.open) {
      if (c == keep || c->evicted || (what != nullptr && c->*what <= 0)) continue;
      if (victim == nullptr || c->active.load(std::memory_order_relaxed) <
                                   victim->active.load(std::memory_order_relaxed)) {
        victim = c;
      }
    }
  }
  if (victim == nullptr) return false;
  // Its descriptor is open: Closing takes it out of `open` under this lock before gRPC closes it.
  victim->evicted = true;
  victim->evicted_streams = victim->streams;
  victim->evicted_partial = victim->partial;
  ++evicting;
  evicting_streams += victim->evicted_streams;
  evicting_partial += victim->evicted_partial;
  syscall(SYS_shutdown, victim->fd, SHUT_RDWR);
  const std::string why = std::string(reason) + "_pushed_out";
  ++closed[why];
  Log(why, victim->peer,
      std::string("the listener's ") +
          (what == &Connection::streams   ? "streams"
           : what == &Connection::partial ? "incomplete uploads"
                                          : "connections") +
          " were full: its least recently active connection made room for another's",
      "attnserve_connections_closed_total");
  return true;
}

void ConnectionGuard::Listener::Evicted(Connection& c) {
  if (!c.evicted) return;
  c.evicted = false;
  --evicting;
  evicting_streams -= c.evicted_streams;
  evicting_partial -= c.evicted_partial;
}

namespace {

int OpenSpare() { return open("/dev/null", O_RDONLY | O_CLOEXEC); }

// The key a listener is guarded under: its port, or a Unix socket's ConnectionGuard::UnixKey.
int ListenerKey(int fd) {
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return 0;
  if (local.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  if (local.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
  if (local.ss_family == AF_UNIX) {
    const auto* un = reinterpret_cast<const sockaddr_un*>(&local);
    const size_t n =
        strnlen(un->sun_path,
                len > offsetof(sockaddr_un, sun_path) ? len - offsetof(sockaddr_un, sun_path) : 0);
    return ConnectionGuard::UnixKey(std::string(un->sun_path, n));
  }
  return 0;
}

// The peer of an accepted connection (core/peer.h), from accept4's address or the socket's own; on
// a Unix socket, the connecting process's user ("unix uid=1000"): one local user cannot take
// another's share of the bounds.
std::string PeerOf(int fd, const sockaddr* addr, socklen_t len) {
  sockaddr_storage peer{};
  if (addr == nullptr || len == 0) {
    socklen_t n = sizeof(peer);
    addr = getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &n) == 0
               ? reinterpret_cast<const sockaddr*>(&peer)
               : nullptr;
  }
  if (addr != nullptr && addr->sa_family == AF_UNIX) {
    ucred cred{};
    socklen_t n = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &n) == 0)
      return "unix uid=" + std::to_string(cred.uid);
  }
  return addr == nullptr ? "unknown" : attnserve::PeerOf(addr);
}

// Closes an accepted connection at once with a reset, so its client learns now, not at a timeout.
void Refuse(int fd) {
  const linger reset{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
  close(fd);
}

// The system's accept4, through a sanitizer runtime's interceptor when there is one (the process's
// own accept4 is the guard's).
int SystemAccept(int listener, sockaddr* addr, socklen_t* len, int flags) {
  using Fn = int (*)(int, sockaddr*, socklen_t*, int);
  static const Fn sanitizer = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "__interceptor_accept4"));
  return sanitizer != nullptr ? sanitizer(listener, addr, len, flags)
                              : static_cast<int>(syscall(SYS_accept4, listener, addr, len, flags));
}

}  // namespace

int ConnectionGuard::UnixKey(const std::string& path) {
  return -1 -
         static_cast<int>(std::hash<std::string>()(path) % (std::numeric_limits<int>::max() - 1));
}

ConnectionGuard& ConnectionGuard::Get() {
  // Never destroyed: gRPC's threads close descriptors until the process is gone.
  static ConnectionGuard* guard = new ConnectionGuard();
  return *guard;
}

ConnectionGuard::ConnectionGuard() : spare_fd_(OpenSpare()) {}

bool ConnectionGuard::Installed() {
  return dlsym(RTLD_DEFAULT, "accept4") != dlsym(RTLD_NEXT, "accept4");
}

void ConnectionGuard::Guard(int port, const std::string& name, const ConnectionLimits& limits,
                            bool plaintext) {
  auto l = std::make_shared<Listener>();
  l->port = port;
  l->name = name;
  l->limits = limits;
  l->plaintext = plaintext;
  {
    std::lock_guard<std::mutex> lock(listeners_mu_);
    listeners_[port] = std::move(l);
  }
  std::call_once(sweeper_, [this] {
    std::thread([this] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        Sweep();
      }
    }).detach();  // The guard is never destroyed.
  });
}

void ConnectionGuard::Sweep() {
  if (tracked_.load(std::memory_order_relaxed) == 0) return;
  std::vector<std::pair<int, std::shared_ptr<Connection>>> all;
  {
    std::shared_lock<std::shared_mutex> lock(conns_mu_);
    all.assign(conns_.begin(), conns_.end());
  }
  const auto now = std::chrono::steady_clock::now();
  for (auto& [fd, c] : all) {
    if (!c->h2) continue;
    std::lock_guard<std::mutex> lock(c->mu);
    const H2Breach late = c->h2->Overdue(now);
    if (!late || c->broken) continue;
    Listener& l = *c->listener;
    std::lock_guard<std::mutex> inner(l.mu);
    // Its descriptor is still gRPC's connection: Closing takes it out of `open` first.
    const auto peer = l.peers.find(c->peer);
    if (peer == l.peers.end() || peer->second.open.count(c.get()) == 0) continue;
    c->broken = true;
    syscall(SYS_shutdown, fd, SHUT_RDWR);
    ++l.closed[late.reason];
    l.Log(late.reason, c->peer, late.detail, "attnserve_connections_closed_total");
  }
}

void ConnectionGuard::Unguard(int port) {
  std::lock_guard<std::mutex> lock(listeners_mu_);
  listeners_.erase(port);
}

int64_t ConnectionGuard::accepted(int port) const {
  std::lock_guard<std::mutex> lock(listeners_mu_);
  const auto it = listeners_.find(port);
  return it == listeners_.end() ? 0 : it->second->accepted.load();
}

GuardCounts ConnectionGuard::counts() const {
  GuardCounts c;
  c.refused["fd_limit"] = fd_limit_refused_.load();
  std::lock_guard<std::mutex> lock(listeners_mu_);
  for (const auto& [port, l] : listeners_) {
    std::lock_guard<std::mutex> inner(l->mu);
    c.connections += l->connections;
    c.streams += l->streams;
    c.partial_bytes += l->partial;
    for (const auto& [reason, n] : l->refused) c.refused[reason] += n;
    for (const auto& [reason, n] : l->closed) c.closed[reason] += n;
  }
  return c;
}

std::shared_ptr<ConnectionGuard::Listener> ConnectionGuard::ListenerOf(int listener_fd) const {
  std::lock_guard<std::mutex> lock(listeners_mu_);
  if (listeners_.empty()) return nullptr;
  const auto it = listeners_.find(ListenerKey(listener_fd));
  return it == listeners_.end() ? nullptr : it->second;
}

std::shared_ptr<ConnectionGuard::Connection> ConnectionGuard::Find(int fd) const {
  std::shared_lock<std::shared_mutex> lock(conns_mu_);
  const auto it = conns_.find(fd);
  return it == conns_.end() ? nullptr : it->second;
}

bool ConnectionGuard::ShedOne(int listener, int flags) {
  std::lock_guard<std::mutex> lock(spare_mu_);
  if (spare_fd_ < 0) {
    spare_fd_ = OpenSpare();
    return false;
  }
  close(spare_fd_);
  const int fd = SystemAccept(listener, nullptr, nullptr, flags);
  if (fd >= 0) Refuse(fd);
  spare_fd_ = OpenSpare();
  if (fd < 0) return false;
  if (fd_limit_refused_.fetch_add(1) % 1000 == 0) {
    std::cerr << "attnserve: out of file descriptors (see ulimit -n): connections are closed as "
                 "they arrive (counted in attnserve_connections_refused_total{reason=\"fd_limit\"})"
              << std::endl;
  }
  return true;
}

int ConnectionGuard::Accept(int listener, sockaddr* addr, socklen_t* len, int flags) {
  const socklen_t capacity = len != nullptr ? *len : 0;
  for (;;) {
    if (len != nullptr) *len = capacity;
    const int fd = SystemAccept(listener, addr, len, flags);
    if (fd < 0) {
      const int error = errno;
      if (error == EMFILE || error == ENFILE) {
        if (ShedOne(listener, flags)) continue;
      }
      // gRPC 1.51 stops accepting for good on any error but these (CVE-2023-4785): a full
      // descriptor table or a kernel short of memory is a moment, not the end of the listener.
      errno = (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) ? EAGAIN
                                                                                          : error;
      return -1;
    }
    const std::shared_ptr<Listener> l = ListenerOf(listener);
    if (!l) return fd;
    l->accepted.fetch_add(1);
    const std::string peer = PeerOf(fd, addr, len != nullptr ? *len : 0);
    // A client end another open connection has (bound where another client is, connected to
    // another of this host's addresses): its calls could not be told from the other's (shared
    // memory knows a caller by it), so it is refused.
    if (!ConnectionEnds::Get().Add(fd)) {
      ConnectionEnds::Get().Remove(fd);
      std::lock_guard<std::mutex> lock(l->mu);
      ++l->refused["shared_client_end"];
      l->Log("shared_client_end", peer,
             "another open connection has its client's address and port (refused as accepted)",
             "attnserve_connections_refused_total");
      Refuse(fd);
      continue;
    }
    std::shared_ptr<Connection> c;
    {
      std::lock_guard<std::mutex> lock(l->mu);
      Listener::Peer& p = l->peers[peer];
      const bool peer_full = p.connections >= l->limits.max_connections_per_peer;
      const bool full = l->connections - l->evicting >= l->limits.max_connections;
      const char* over = peer_full ? "peer_connections" : full ? "max_connections" : nullptr;
      // The listener full: its least recently active connection makes room.
      if (!peer_full && full && l->Evict(nullptr, nullptr, "max_connections")) over = nullptr;
      if (over != nullptr) {
        ++l->refused[over];
        l->Log(over, peer,
               std::string(peer_full ? "its peer address has --max-connections-per-peer open"
                                     : "the listener has --max-connections open") +
                   " (refused as accepted)",
               "attnserve_connections_refused_total");
        l->Forget(peer);
        ConnectionEnds::Get().Remove(fd);
        Refuse(fd);
        continue;
      }
      ++p.connections;
      ++l->connections;
      c = std::make_shared<Connection>();
      c->listener = l;
      c->peer = peer;
      c->fd = fd;
      p.open.insert(c.get());
    }
    if (l->plaintext) c->h2 = std::make_unique<H2Inspector>(l->limits.h2, c.get());
    std::unique_lock<std::shared_mutex> lock(conns_mu_);
    if (conns_.insert_or_assign(fd, std::move(c)).second) tracked_.fetch_add(1);
    return fd;
  }
}

void ConnectionGuard::Break(int fd, Connection& c, const H2Breach& breach) {
  c.broken = true;
  syscall(SYS_shutdown, fd, SHUT_RDWR);
  Listener& l = *c.listener;
  std::lock_guard<std::mutex> lock(l.mu);
  ++l.closed[breach.reason];
  l.Log(breach.reason, c.peer, breach.detail, "attnserve_connections_closed_total");
}

ssize_t ConnectionGuard::Received(int fd, const msghdr* msg, ssize_t n) {
  if (n <= 0 || tracked_.load(std::memory_order_relaxed) == 0) return n;
  const std::shared_ptr<Connection> c = Find(fd);
  if (!c) return n;
  if (!c->h2) {  // TLS: any bytes are the client at work.
    c->Active();
    return n;
  }
  std::lock_guard<std::mutex> lock(c->mu);
  if (!c->broken) {
    const auto now = std::chrono::steady_clock::now();
    size_t left = static_cast<size_t>(n);
    for (size_t i = 0; i < msg->msg_iovlen && left > 0; ++i) {
      const size_t take = std::min(left, msg->msg_iov[i].iov_len);
      const H2Breach breach =
          c->h2->OnReceived(static_cast<const uint8_t*>(msg->msg_iov[i].iov_base), take, now);
      if (breach) {
        Break(fd, *c, breach);
        break;
      }
      left -= take;
    }
  }
  if (!c->broken) return n;
  errno = ECONNRESET;
  return -1;
}

void ConnectionGuard::Sent(int fd, const msghdr* msg, ssize_t n) {
  if (n <= 0 || tracked_.load(std::memory_order_relaxed) == 0) return;
  const std::shared_ptr<Connection> c = Find(fd);
  if (!c || !c->h2) return;
  std::lock_guard<std::mutex> lock(c->mu);
  size_t left = static_cast<size_t>(n);
  for (size_t i = 0; i < msg->msg_iovlen && left > 0; ++i) {
    const size_t take = std::min(left, msg->msg_iov[i].iov_len);
    c->h2->OnSent(static_cast<const uint8_t*>(msg->msg_iov[i].iov_base), take);
    left -= take;
  }
}

void ConnectionGuard::Closing(int fd) {
  if (tracked_.load(std::memory_order_relaxed) == 0) return;
  std::shared_ptr<Connection> gone;
  {
    std::unique_lock<std::shared_mutex> lock(conns_mu_);
    const auto it = conns_.find(fd);
    if (it == conns_.end()) return;
    gone = std::move(it->second);
    conns_.erase(it);
    tracked_.fetch_sub(1);
  }
  ConnectionEnds::Get().Remove(fd);
  {
    // Before the descriptor closes: no eviction may shut it from now on.
    Listener& l = *gone->listener;
    std::lock_guard<std::mutex> lock(l.mu);
    if (l.peers[gone->peer].open.erase(gone.get()) > 0) l.Evicted(*gone);
  }
  // Its accounts go back here, outside the table's lock (or later, when a read in progress ends).
}

}  // namespace attnserve
