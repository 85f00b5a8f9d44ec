// The two C library functions attnserve replaces for every library in its process, both for a
// known gRPC 1.51 / glibc behaviour (docs/grpc-workarounds.md). Linked only into executables that
// ask for them (CMake's attnserve_interposers: the `attnserve` executable and the tests of these
// two behaviours); each such executable exports both symbols so shared libraries' calls land here.
#include <dlfcn.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "server/process/socket_linger.h"
#include "server/process/thread_stacks.h"

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
