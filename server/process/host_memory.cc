#include "server/process/host_memory.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

namespace attnserve {
namespace {

// The file's first number; -1 when it is missing, "max" or not a number.
int64_t ReadLimit(const std::string& path) {
  std::ifstream f(path);
  std::string text;
  if (!(f >> text) || text == "max") return -1;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  return end != text.c_str() && v > 0 ? v : -1;
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// `mount` + `path` and each folder above it up to `mount` itself: a cgroup's limit is the
// smallest along its path. A path that is not under the mount (a container's own cgroup mounted
// at its root while /proc/self/cgroup names the host's path) leaves the mount's own files (a
// missing folder reads as no limit).
std::vector<std::string> CgroupDirs(const std::string& mount, std::string path) {
  std::vector<std::string> dirs;
  while (!path.empty() && path != "/") {
    dirs.push_back(mount + path);
    path = path.substr(0, path.rfind('/'));
  }
  dirs.push_back(mount);
  return dirs;
}

// The smallest limit of `file` along the dirs, with the file that gave it.
MemoryLimit Smallest(const std::vector<std::string>& dirs, const std::string& file) {
  MemoryLimit found;
  for (const std::string& d : dirs) {
    const int64_t v = ReadLimit(d + "/" + file);
    if (v > 0 && (found.bytes == 0 || v < found.bytes)) found = {v, d + "/" + file};
  }
  return found;
}

}  // namespace

MemoryLimit ContainerMemoryLimit(const std::string& root, const std::string& self_cgroup) {
  // Lines "id:controllers:path": v2's is "0::path", v1's memory one names "memory".
  std::string v1_path, v2_path;
  bool v1 = false, v2 = false;
  std::ifstream f(self_cgroup);
  for (std::string line; std::getline(f, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::stringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) {
      if (c == "memory") {
        v1 = true;
        v1_path = line.substr(b + 1);
      }
    }
    if (line.compare(0, 3, "0::") == 0) {
      v2 = true;
      v2_path = line.substr(b + 1);
    }
  }
  MemoryLimit limit;
  if (v1 && Exists(root + "/memory")) {
    limit = Smallest(CgroupDirs(root + "/memory", v1_path), "memory.limit_in_bytes");
  } else if (v2 && Exists(root + "/cgroup.controllers")) {
    limit = Smallest(CgroupDirs(root, v2_path), "memory.max");
  }
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (physical > 0 && limit.bytes >= physical) limit = {};  // v1's "no limit" is a huge number.
  return limit;
}

int64_t ResidentBytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.compare(0, 6, "VmRSS:") == 0)
      return std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

void KeepMessageBuffers() {
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(kKeptBufferBytes));
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimBytes));
}

}  // namespace attnserve
