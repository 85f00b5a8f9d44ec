#pragma once

#include <cstdint>
#include <string>

namespace attnserve {

/// The memory limit the process runs under: its cgroup's (a container's `--memory`, a Kubernetes
/// memory limit), the smallest along its cgroup path, as cgroup v2 (`memory.max`) or v1
/// (`memory.limit_in_bytes`) says it. `bytes` is 0 when there is none (or it is no lower than the
/// machine's memory); `source` names the file it came from.
struct MemoryLimit {
  int64_t bytes = 0;
  std::string source;
};

/// Reads the limit for this process. `root` is where the cgroup file systems are mounted and
/// `self_cgroup` the process's cgroup list (tests point both at a fake tree).
MemoryLimit ContainerMemoryLimit(const std::string& root = "/sys/fs/cgroup",
                                 const std::string& self_cgroup = "/proc/self/cgroup");

/// This process's resident memory (VmRSS), in bytes; 0 when unknown.
int64_t ResidentBytes();

/// glibc's malloc keeps blocks of up to kKeptBufferBytes (its largest: 32 MiB) in its heap between
/// calls instead of mapping fresh pages for each and unmapping them when freed (its default past
/// 128 KiB, raised only as blocks are freed), and keeps up to kTrimBytes free at a heap's top. A
/// request's buffers and the engine's temporaries (a lone [1, 1024, 512] request's attention
/// scores: 32 MB) then cost no page faults: the kernel took 30% of the server's CPU on that
/// request, which computed in 17-21 ms against the same engine's 11 ms in process; now 13 ms. A 2
/// MB echo round trip 1.8 -> 1.4 ms (bench/RESULTS.md "The wire's floor"). The free memory kept is
/// given back when the batcher goes idle (malloc_trim).
void KeepMessageBuffers();
inline constexpr int64_t kKeptBufferBytes = int64_t{32} << 20;  // mallopt's most
inline constexpr int64_t kTrimBytes = int64_t{256} << 20;

}  // namespace attnserve
