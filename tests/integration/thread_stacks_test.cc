// Threads created with a small explicit stack (civetweb's 100 KiB, under the metrics exporter)
// must start and get the stack they asked for, although this process carries ~105 KB of static
// TLS (LibTorch, glog, the pthread OpenBLAS) that glibc places inside every thread's stack.
#include "server/process/thread_stacks.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <cstring>

#include "server/engine/blas.h"

namespace attnserve {
namespace {

void* UseStack(void* bytes) {
  // Touch most of the requested stack, as a thread that asked for it may.
  const size_t n = *static_cast<size_t*>(bytes);
  volatile char* buf = static_cast<volatile char*>(__builtin_alloca(n));
  for (size_t i = 0; i < n; i += 512) buf[i] = static_cast<char>(i);
  return nullptr;
}

TEST(ThreadStacksTest, SmallRequestedStackHoldsWhatWasAskedFor) {
  ConfigureBlas();  // The engine's BLAS set-up, as in the server.
  EXPECT_TRUE(ThreadStacksIncludeStaticTls());
  EXPECT_GT(StaticTlsBytes(), 0u);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 100 * 1024), 0);
  size_t use = 80 * 1024;
  pthread_t thread;
  const int rc = pthread_create(&thread, &attr, UseStack, &use);
  pthread_attr_destroy(&attr);
  ASSERT_EQ(rc, 0) << "pthread_create with a 100 KiB stack: " << std::strerror(rc)
                   << " (static TLS " << StaticTlsBytes() << " bytes)";
  pthread_join(thread, nullptr);
}

TEST(ThreadStacksTest, LoadedBlasIsThreadSafe) {
  const BlasInfo blas = ConfigureBlas();
  EXPECT_TRUE(blas.thread_safe) << blas.description;
}

}  // namespace
}  // namespace attnserve
