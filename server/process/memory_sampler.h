#pragma once

#include <atomic>
#include <string>

#include "server/engine/host_staging.h"
#include "server/pipeline/metrics.h"

namespace attnserve {

/// Refreshes the memory gauges after each computed batch: on CUDA the device allocator's
/// (attnserve_device_memory_*), on the CPU the process's resident set
/// (attnserve_host_memory_bytes), read at most once a second since a /proc read per batch would
/// cost more than the gauge is worth. Thread-safe.
class MemorySampler {
 public:
  /// `device`: the server's --device ("cpu", "cuda", "cuda:N"); `staging`: its pinned staging
  /// (CUDA; may be null), borrowed.
  MemorySampler(const std::string& device, ServerMetrics& metrics,
                const HostStaging* staging = nullptr);
  void Sample();

 private:
  ServerMetrics& metrics_;
  const HostStaging* staging_;
  std::atomic<int64_t> refused_seen_{0};
  int cuda_index_ = -1;  // -1: the CPU.
  std::atomic<int64_t> last_read_ns_{0};
};

}  // namespace attnserve
