// Built only against a CUDA LibTorch (CMake: ATTNSERVE_CUDA). The rest of the engine reaches the
// GPU through c10's device-generic interfaces; the caching allocator's statistics have none.
#include <c10/cuda/CUDACachingAllocator.h>

#include "server/engine/device_support.h"

namespace attnserve {

bool BuiltWithCuda() { return true; }

bool ReadDeviceMemory(int index, DeviceMemory* out) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  // Entry 0 of each StatArray is the aggregate over the allocator's pools.
  out->allocated = stats.allocated_bytes[0].current;
  out->reserved = stats.reserved_bytes[0].current;
  return true;
}

void ReleaseCachedDeviceMemory() { c10::cuda::CUDACachingAllocator::emptyCache(); }

}  // namespace attnserve
