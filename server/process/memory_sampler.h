#pragma once

#include <atomic>
#include <string>

#include "server/pipeline/metrics.h"

namespace attnserve {

/// Refreshes the memory gauges after each computed batch: on CUDA the device allocator's
/// (attnserve_device_memory_*), on the CPU the process's resident set
/// (attnserve_host_memory_bytes), read at most once a second since a /proc read per batch would
/// cost more than the gauge is worth. Thread-safe.
class MemorySampler {
 public:
  /// `device`: the server's --device ("cpu", "cuda", "cuda:N").
  MemorySampler(const std::string& device, ServerMetrics& metrics);
  void Sample();

 private:
  ServerMetrics& metrics_;
  int cuda_index_ = -1;  // -1: the CPU.
  std::atomic<int64_t> last_read_ns_{0};
};

}  // namespace attnserve
