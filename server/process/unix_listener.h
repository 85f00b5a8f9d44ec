#pragma once
// The Unix domain socket the server listens on beside TCP (--address unix:PATH): where gRPC binds
// it, how it comes to PATH with its mode, and how it goes. Built so that no other local process can
// turn it against a file or socket that is not the server's own (docs/api.md "Unix domain socket"):
//   - A lock (PATH.lock, flock, held for the process's life) lets one server own PATH at a time.
//   - What is at PATH may be replaced only when it is a socket no one listens on: a file, a
//     directory, a FIFO, a symlink, a socket another process accepts on (or keeps waiting with a
//     full backlog), or one this process may not connect to is refused, naming it.
//   - gRPC binds in a private directory of this process (0700, beside PATH), the socket gets its
//     mode there, and a rename() puts it at PATH whole: no moment with the umask's mode, no chmod
//     of a path another process could swap for a symlink, and gRPC never sees PATH (it would
//     percent-decode it).
//   - At the stop, PATH is removed only while it is still this socket (its inode).
#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>

#include "server/core/status.h"

namespace attnserve {

class UnixListener {
 public:
  /// Takes PATH's lock, checks what is there, and makes the private directory. INVALID_ARGUMENT or
  /// FAILED_PRECONDITION naming `path` and why.
  static StatusOr<std::unique_ptr<UnixListener>> Prepare(const std::string& path, int mode);
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  /// The address gRPC binds ("unix:" + a path in the private directory).
  std::string BindAddress() const { return "unix:" + bound_; }
  /// The connection guard's key for its connections (ConnectionGuard::UnixKey of the bound path:
  /// what getsockname says of them).
  int GuardKey() const;
  /// Once gRPC listens: gives the socket its mode and moves it to PATH.
  Status Publish();
  /// Removes PATH while it is this socket, and the private directory; lets the lock go.
  void Remove();

 private:
  UnixListener(std::string path, int mode) : path_(std::move(path)), mode_(mode) {}
  std::string path_, dir_, bound_;
  int mode_ = 0660;
  int lock_fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  bool published_ = false;
};

/// Parses --unix-socket-mode's octal text (e.g. "0660", "600"): nullopt unless it is 1-4 octal
/// digits of at most 0777.
std::optional<int> ParseSocketMode(const std::string& text);

}  // namespace attnserve
