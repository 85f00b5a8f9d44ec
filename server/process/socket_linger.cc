#include "server/process/socket_linger.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <linux/tcp.h>  // Linux's tcp_info (glibc's lacks tcpi_bytes_acked); states below.
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>

namespace attnserve {
namespace {

// TCP states (include/net/tcp_states.h: kernel ABI, not in Linux's user headers).
constexpr uint8_t kFinWait1 = 4, kTimeWait = 6, kClose = 7, kCloseWait = 8, kLastAck = 9,
                  kClosing = 11;

// The sockets held, by inode, for this file's `shutdown` (gRPC's threads call it).
std::mutex lingering_mu;
std::set<unsigned long>& Lingering() {
  static auto* inodes = new std::set<unsigned long>;
  return *inodes;
}
std::atomic<int> lingering_count{0};  // Its size, read without the lock by every shutdown.

unsigned long SocketInode(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

bool IsLingering(int fd) {
  if (lingering_count.load(std::memory_order_acquire) == 0) return false;
  const unsigned long inode = SocketInode(fd);
  std::lock_guard<std::mutex> lock(lingering_mu);
  return inode != 0 && Lingering().count(inode) > 0;
}

void SetLingering(unsigned long inode, bool on) {
  std::lock_guard<std::mutex> lock(lingering_mu);
  if (on ? Lingering().insert(inode).second : Lingering().erase(inode) > 0) {
    lingering_count.fetch_add(on ? 1 : -1, std::memory_order_release);
  }
}

// The local port of a connected (not listening) TCP socket; 0 for anything else.
int ConnectedTcpPort(int fd) {
  int value = 0;
  socklen_t len = sizeof(value);
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &value, &len) != 0 || value) return 0;
  len = sizeof(value);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &value, &len) != 0 || value != SOCK_STREAM) return 0;
  sockaddr_storage local{};
  len = sizeof(local);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return 0;
  if (local.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  if (local.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
  return 0;
}

// TCP_INFO; false when unavailable.
bool Info(int fd, tcp_info& info) {
  info = {};
  socklen_t len = sizeof(info);
  return getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0;
}

// Bytes sent and not yet acknowledged by the client; after our FIN the queue counts it as one more.
int Unacknowledged(int fd, const tcp_info& info) {
  int queued = 0;
  if (ioctl(fd, SIOCOUTQ, &queued) != 0) return 0;
  const uint8_t state = info.tcpi_state;
  const bool fin_sent = state == kFinWait1 || state == kClosing || state == kLastAck;
  return fin_sent && queued > 0 ? queued - 1 : queued;
}

// Reads and drops what the client sent (gRPC has closed the connection: nobody reads it). False
// once the client has closed its end or the connection is gone.
bool DrainInput(int fd, bool& heard) {
  char buffer[16 << 10];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      heard = true;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

}  // namespace

SocketLinger::~SocketLinger() {
  for (const auto& [inode, held] : held_) {
    close(held.fd);
    SetLingering(inode, false);
  }
}

bool SocketLinger::Holds(int fd) { return IsLingering(fd); }

bool SocketLinger::Installed() {
  // The process's `shutdown` is not the C library's (the next definition after the executable).
  return dlsym(RTLD_DEFAULT, "shutdown") != dlsym(RTLD_NEXT, "shutdown");
}

int SocketLinger::HoldConnectionsOn(int port) {
  if (port <= 0) return static_cast<int>(held_.size());
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return static_cast<int>(held_.size());
  const int dir_fd = dirfd(dir);
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const int fd = static_cast<int>(std::strtol(entry->d_name, &end, 10));
    if (end == entry->d_name || *end != '\0' || fd == dir_fd) continue;
    const unsigned long inode = SocketInode(fd);
    if (inode == 0 || held_.count(inode) || ConnectedTcpPort(fd) != port) continue;
    const int ours = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (ours < 0) continue;
    // gRPC may have closed `fd` and the number been reused since it was looked at: keep the copy
    // only when it is the socket that was checked.
    if (SocketInode(ours) != inode || ConnectedTcpPort(ours) != port) {
      close(ours);
      continue;
    }
    Held held;
    held.fd = ours;
    tcp_info info;
    if (Info(ours, info)) {
      held.sent_at_hold = info.tcpi_bytes_acked + static_cast<uint64_t>(Unacknowledged(ours, info));
    }
    held_.emplace(inode, held);
    SetLingering(inode, true);
  }
  closedir(dir);
  return static_cast<int>(held_.size());
}

SocketLinger::State SocketLinger::Look(Held& held, std::chrono::steady_clock::time_point now) {
  bool heard = false;
  if (!DrainInput(held.fd, heard)) return State::kDone;  // The client closed: it read it all.
  if (heard) held.heard = now;
  tcp_info info;
  if (!Info(held.fd, info)) return State::kDone;
  const uint8_t state = info.tcpi_state;
  if (state == kClose || state == kTimeWait || state == kCloseWait) return State::kDone;
  if (Unacknowledged(held.fd, info) > 0) {
    held.acknowledged = {};
    return State::kUnread;
  }
  if (held.acknowledged == std::chrono::steady_clock::time_point{}) held.acknowledged = now;
  if (now - held.acknowledged >= kAcknowledgedLinger) return State::kDone;
  const bool answered = info.tcpi_bytes_acked > held.sent_at_hold + kGoodbyeBytes;
  return now - held.heard >= (answered ? kAnsweredQuiet : kIdleQuiet) ? State::kDone
                                                                      : State::kQuieting;
}

int SocketLinger::CloseWhenRead(std::chrono::steady_clock::time_point deadline) {
  for (auto& [inode, held] : held_) held.heard = std::chrono::steady_clock::now();
  int unread = 0;
  while (!held_.empty()) {
    const auto now = std::chrono::steady_clock::now();
    const bool last_look = now >= deadline;
    for (auto it = held_.begin(); it != held_.end();) {
      const State state = Look(it->second, now);
      if (state == State::kDone || last_look) {
        unread += state == State::kUnread;
        close(it->second.fd);
        SetLingering(it->first, false);
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    if (!held_.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return unread;
}

}  // namespace attnserve
