#include "server/process/unix_listener.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "server/process/connection_guard.h"

namespace attnserve {

namespace {

constexpr size_t kMaxPath = sizeof(sockaddr_un::sun_path) - 1;

Status Refused(const std::string& path, const std::string& why) {
  return Status(StatusCode::kFailedPrecondition, "--address unix:" + path + ": " + why);
}

std::string What(mode_t m) {
  return S_ISLNK(m) ? "a symlink" : S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : "a file";
}

// Whether a process accepts on the socket at `path`: connected or waiting in a full backlog
// (EAGAIN) is yes, refused is no; anything else (no permission to connect) cannot tell, and is
// treated as yes. Never blocks.
Status SocketIsDead(const std::string& path) {
  sockaddr_un un{};
  un.sun_family = AF_UNIX;
  std::memcpy(un.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Refused(path, std::string("cannot make a socket: ") + std::strerror(errno));
  const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&un), sizeof(un));
  const int err = errno;
  close(fd);
  if (rc != 0 && err == ECONNREFUSED) return Status::Ok();
  if (rc == 0 || err == EAGAIN) return Refused(path, "another process listens on that socket");
  return Refused(path,
                 std::string("a socket this process cannot connect to, to see whether another "
                             "listens on it (") +
                     std::strerror(err) + ")");
}

// Nothing at `path`, or a socket no one listens on: what the server may replace.
Status Replaceable(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return Refused(path, What(st.st_mode) + " is there, not a socket: it is left as it is");
    }
    return SocketIsDead(path);
  }
  if (errno != ENOENT) {
    return Refused(path, std::string("cannot look at it (") + std::strerror(errno) + ")");
  }
  return Status::Ok();
}

}  // namespace

std::optional<int> ParseSocketMode(const std::string& text) {
  if (text.empty() || text.size() > 4) return std::nullopt;
  int mode = 0;
  for (char c : text) {
    if (c < '0' || c > '7') return std::nullopt;
    mode = mode * 8 + (c - '0');
  }
  if (mode > 0777) return std::nullopt;
  return mode;
}

StatusOr<std::unique_ptr<UnixListener>> UnixListener::Prepare(const std::string& path, int mode) {
  if (path.empty()) {
    return Status(StatusCode::kInvalidArgument, "--address unix: needs a path (unix:PATH)");
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  // The private directory's socket: DIR/.attnserve-XXXXXX/s.
  const size_t bound_size = dir.size() + std::strlen("/.attnserve-XXXXXX/s");
  if (path.size() > kMaxPath || bound_size > kMaxPath) {
    return Status(StatusCode::kInvalidArgument,
                  "--address unix:" + path + ": a path of " + std::to_string(path.size()) +
                      " bytes in a directory of " + std::to_string(dir.size()) +
                      "; a socket address holds " + std::to_string(kMaxPath) +
                      ", and the server binds it first in a directory beside it (the directory " +
                      "at most " + std::to_string(kMaxPath - (bound_size - dir.size())) + ")");
  }
  // What is there, before a lock file is made beside it (a directory given as the path is left
  // with nothing new next to it); again under the lock, which a server starting beside this one
  // may have had first.
  RETURN_IF_ERROR(Replaceable(path));
  std::unique_ptr<UnixListener> l(new UnixListener(path, mode));
  const std::string lock = path + ".lock";
  l->lock_fd_ = open(lock.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (l->lock_fd_ < 0) {
    return Refused(path, "cannot open its lock " + lock + " (" + std::strerror(errno) + ")");
  }
  if (flock(l->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return Refused(path, "another attnserve serves on it (it holds " + lock + ")");
  }
  RETURN_IF_ERROR(Replaceable(path));
  std::string made = dir + "/.attnserve-XXXXXX";
  if (mkdtemp(made.data()) == nullptr) {
    return Refused(path, "cannot make a private directory beside it in " + dir + " (" +
                             std::strerror(errno) + ")");
  }
  l->dir_ = made;
  l->bound_ = made + "/s";
  return l;
}

UnixListener::~UnixListener() { Remove(); }

int UnixListener::GuardKey() const { return ConnectionGuard::UnixKey(bound_); }

Status UnixListener::Publish() {
  // The directory is this process's alone (0700): no one can swap the socket for a symlink here.
  if (chmod(bound_.c_str(), static_cast<mode_t>(mode_)) != 0) {
    return Refused(path_, std::string("cannot set its mode (") + std::strerror(errno) + ")");
  }
  struct stat st {};
  if (lstat(bound_.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return Refused(path_, "gRPC's socket is not where it was bound");
  }
  if (rename(bound_.c_str(), path_.c_str()) != 0) {
    return Refused(path_,
                   std::string("cannot move the socket there (") + std::strerror(errno) + ")");
  }
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  published_ = true;
  rmdir(dir_.c_str());
  return Status::Ok();
}

void UnixListener::Remove() {
  if (published_) {
    struct stat st {};
    if (lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) && st.st_dev == dev_ &&
        st.st_ino == ino_) {
      unlink(path_.c_str());
    }
    published_ = false;
  }
  if (!dir_.empty()) {
    unlink(bound_.c_str());
    rmdir(dir_.c_str());
    dir_.clear();
  }
  if (lock_fd_ >= 0) {
    close(lock_fd_);  // The lock goes with it; the file stays (removing it would race the next).
    lock_fd_ = -1;
  }
}

}  // namespace attnserve
