// The C library functions attnserve replaces for every library in its process, each for a known
// gRPC 1.51 / glibc behaviour (docs/grpc-workarounds.md). Linked only into executables that ask for
// them (CMake's attnserve_interposers: the `attnserve` executable and the tests of these
// behaviours); each such executable exports these symbols so shared libraries' calls land here.
// Under a sanitizer, whose runtime intercepts some of the same calls, its interceptor is called in
// turn (__interceptor_NAME), so that it still sees them.
#include <dlfcn.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "server/process/connection_guard.h"
#include "server/process/socket_linger.h"
#include "server/process/thread_stacks.h"

namespace {

// A sanitizer runtime's interceptor of `name` (null without one): statically linked into the
// executable, it would be shadowed by the definitions below.
template <typename Fn>
Fn Intercepted(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

// gRPC shuts a connection down both ways before it closes it; for a held connection only the
// sending side is shut (the rest of the answer, then the end of the stream, still go out), so what
// the client sends next is not answered with a reset. Every other call is passed on unchanged.
extern "C" int shutdown(int fd, int how) noexcept {
  if (how != SHUT_WR && attnserve::SocketLinger::Holds(fd)) how = SHUT_WR;
  return static_cast<int>(syscall(SYS_shutdown, fd, how));
}

// Every requested stack size plus the static TLS glibc carves out of it (thread_stacks.h).
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t stacksize) noexcept {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn glibc = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return glibc(attr, stacksize + attnserve::StaticTlsBytes());
}

// gRPC's listeners' accept loop, kept running and bounded (ConnectionGuard::Accept).
extern "C" int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  return attnserve::ConnectionGuard::Get().Accept(fd, addr, len, flags);
}

// What guarded connections' clients send (ConnectionGuard::Received) and are sent.
extern "C" ssize_t recvmsg(int fd, msghdr* msg, int flags) {
  using Fn = ssize_t (*)(int, msghdr*, int);
  static const Fn sanitizer = Intercepted<Fn>("__interceptor_recvmsg");
  const ssize_t n = sanitizer != nullptr
                        ? sanitizer(fd, msg, flags)
                        : static_cast<ssize_t>(syscall(SYS_recvmsg, fd, msg, flags));
  if (flags & (MSG_PEEK | MSG_ERRQUEUE)) return n;
  return attnserve::ConnectionGuard::Get().Received(fd, msg, n);
}

extern "C" ssize_t sendmsg(int fd, const msghdr* msg, int flags) {
  using Fn = ssize_t (*)(int, const msghdr*, int);
  static const Fn sanitizer = Intercepted<Fn>("__interceptor_sendmsg");
  const ssize_t n = sanitizer != nullptr
                        ? sanitizer(fd, msg, flags)
                        : static_cast<ssize_t>(syscall(SYS_sendmsg, fd, msg, flags));
  attnserve::ConnectionGuard::Get().Sent(fd, msg, n);
  return n;
}

// A guarded connection's accounts end with its descriptor.
extern "C" int close(int fd) {
  using Fn = int (*)(int);
  static const Fn sanitizer = Intercepted<Fn>("__interceptor_close");
  attnserve::ConnectionGuard::Get().Closing(fd);
  return sanitizer != nullptr ? sanitizer(fd) : static_cast<int>(syscall(SYS_close, fd));
}
