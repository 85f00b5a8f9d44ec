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

}  // namespace attnserve
