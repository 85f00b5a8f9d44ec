#include "server/pipeline/host_cpus.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <thread>

namespace attnserve {
namespace {

// cgroup v2's cpu.max ("max 100000" or "<quota> <period>"), then v1's cfs files; 0 when unlimited.
int QuotaCpus() {
  long long quota = -1, period = 0;
  if (FILE* f = std::fopen("/sys/fs/cgroup/cpu.max", "r")) {
    char q[32] = {};
    if (std::fscanf(f, "%31s %lld", q, &period) == 2 && std::string_view(q) != "max")
      quota = std::atoll(q);
    std::fclose(f);
  } else if (FILE* fq = std::fopen("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "r")) {
    if (std::fscanf(fq, "%lld", &quota) != 1) quota = -1;
    std::fclose(fq);
    if (FILE* fp = std::fopen("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "r")) {
      if (std::fscanf(fp, "%lld", &period) != 1) period = 0;
      std::fclose(fp);
    }
  }
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>((quota + period - 1) / period);
}

}  // namespace

int UsableCpus() {
  int cpus = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  if (const int quota = QuotaCpus(); quota > 0) cpus = std::min(cpus, quota);
  return std::max(1, cpus);
}

}  // namespace attnserve
