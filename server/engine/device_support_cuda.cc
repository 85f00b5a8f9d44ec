// Built only against a CUDA LibTorch (CMake: ATTNSERVE_CUDA). The rest of the engine reaches the
// GPU through c10's device-generic interfaces; the caching allocator's statistics and CUDA event
// timing have none.
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include "server/engine/device_support.h"

namespace attnserve {

bool BuiltWithCuda() { return true; }

bool ReadDeviceMemory(int index, DeviceMemory* out) {
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  // Entry 0 of each StatArray is the aggregate over the allocator's pools.
  out->allocated = stats.allocated_bytes[0].current;
  out->reserved = stats.reserved_bytes[0].current;
  return true;
}

void ReleaseCachedDeviceMemory() { c10::cuda::CUDACachingAllocator::emptyCache(); }

struct DeviceTimer::Events {
  at::cuda::CUDAEvent start{cudaEventDefault};  // Timing events (the default flags disable timing).
  at::cuda::CUDAEvent stop{cudaEventDefault};
};

DeviceTimer::DeviceTimer(bool cuda) {
  if (!cuda) return;
  events_ = std::make_unique<Events>();
  events_->start.record(c10::cuda::getCurrentCUDAStream());
}

DeviceTimer::~DeviceTimer() = default;

double DeviceTimer::Seconds() {
  if (!events_) return -1;
  events_->stop.record(c10::cuda::getCurrentCUDAStream());
  events_->stop.synchronize();
  return events_->start.elapsed_time(events_->stop) / 1e3;  // elapsed_time is in milliseconds
}

}  // namespace attnserve
