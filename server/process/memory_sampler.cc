#include "server/process/memory_sampler.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "server/engine/device_support.h"

namespace attnserve {

MemorySampler::MemorySampler(const std::string& device, ServerMetrics& metrics,
                             const HostStaging* staging)
    : metrics_(metrics), staging_(staging) {
  if (device.rfind("cuda", 0) == 0)
    cuda_index_ = device.size() > 5 ? std::atoi(device.c_str() + 5) : 0;
}

void MemorySampler::Sample() {
  if (staging_) {
    // Counted once however many threads sample: each refusal goes to the counter by one of them.
    const int64_t refused = staging_->refused();
    int64_t seen = refused_seen_.load();
    while (refused > seen && !refused_seen_.compare_exchange_weak(seen, refused)) {
    }
    metrics_.SetStaging(staging_->held_bytes(), staging_->budget_bytes(),
                        refused > seen ? refused - seen : 0);
  }
  if (cuda_index_ >= 0) {
    DeviceMemory memory;
    if (ReadDeviceMemory(cuda_index_, &memory)) {
      metrics_.SetDeviceMemory("cuda:" + std::to_string(cuda_index_), memory.allocated,
                               memory.reserved);
    }
    return;
  }
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  int64_t last = last_read_ns_.load(std::memory_order_relaxed);
  if (now - last < 1'000'000'000 || !last_read_ns_.compare_exchange_strong(last, now)) return;
  long pages_total = 0, pages_resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages_total, &pages_resident) == 2) {
      metrics_.SetHostMemory(static_cast<int64_t>(pages_resident) * sysconf(_SC_PAGESIZE));
    }
    std::fclose(f);
  }
}

}  // namespace attnserve
