#pragma once

#include <cstddef>

namespace attnserve {

/// Bytes of static TLS (the PT_TLS blocks of the executable and the libraries loaded with it) that
/// glibc places at the top of every thread's stack. Computed once. Thread-safe.
size_t StaticTlsBytes();

/// True when this process's pthread_attr_setstacksize is attnserve's (interposers.cc), which adds
/// StaticTlsBytes() to every requested stack size, so a thread gets the usable stack it asked for.
bool ThreadStacksIncludeStaticTls();

}  // namespace attnserve
