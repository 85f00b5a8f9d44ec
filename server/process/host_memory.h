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

/// glibc's malloc keeps buffers of up to kKeptBufferBytes in its heap between calls, instead of
/// mapping fresh pages for each (its default for blocks past 128 KiB, adjusted up only after the
/// first is freed) and unmapping them when freed: a 2 MB request and answer each way then cost no
/// page faults (an attnserve-echo round trip of 2 MB 1.8 -> 1.3-1.6 ms, 256 KB 0.37 -> 0.31,
/// bench/RESULTS.md "The wire's floor"). The free memory the heap keeps is given back when the
/// batcher goes idle (malloc_trim), and past kTrimBytes at its top at any time.
void KeepMessageBuffers();
inline constexpr int64_t kKeptBufferBytes = int64_t{8} << 20;
inline constexpr int64_t kTrimBytes = int64_t{32} << 20;

}  // namespace attnserve
