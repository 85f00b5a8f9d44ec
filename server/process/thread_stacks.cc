// Thread stacks that hold what their creator asked for.
//
// glibc allocates a thread's static TLS (every PT_TLS block of the executable and of the libraries
// loaded with it) inside the stack size the creator requested (glibc bug 11787). attnserve's
// process carries ~105 KB of it: the thread-safe OpenBLAS (libopenblas0-pthread, 61 KB), glog
// (30 KB) and LibTorch (10 KB). Debian's civetweb, under prometheus-cpp's Exposer, creates its
// threads with a fixed 100 KiB stack (USE_STACK_SIZE, not configurable at run time), so they could
// not even start: the Exposer threw "null context when constructing CivetServer".
//
// The executable therefore defines pthread_attr_setstacksize (process/interposers.cc): the
// requested size plus StaticTlsBytes(), then glibc's own function. Symbol interposition makes
// every library's call land there (CMake's attnserve_interposers exports it). Threads created
// without an explicit size (gRPC's, LibTorch's, std::thread) are not affected: glibc's default
// stack (8 MiB) is already far larger.
#include "server/process/thread_stacks.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

namespace attnserve {
namespace {

int AddTlsBlock(dl_phdr_info* info, size_t, void* total) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_TLS) continue;
    const size_t align = ph.p_align > 0 ? ph.p_align : 1;
    *static_cast<size_t*>(total) += (ph.p_memsz + align - 1) / align * align;
  }
  return 0;
}

}  // namespace

size_t StaticTlsBytes() {
  static const size_t bytes = [] {
    size_t total = 0;
    dl_iterate_phdr(AddTlsBlock, &total);
    // glibc also keeps the thread descriptor and a little surplus there; one page covers both.
    return (total + 4096 + 4095) / 4096 * 4096;
  }();
  return bytes;
}

bool ThreadStacksIncludeStaticTls() {
  // The process's function is not the C library's (the next definition after the executable).
  return dlsym(RTLD_DEFAULT, "pthread_attr_setstacksize") !=
         dlsym(RTLD_NEXT, "pthread_attr_setstacksize");
}

}  // namespace attnserve
