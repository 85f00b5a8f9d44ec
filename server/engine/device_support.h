#pragma once

#include <cstdint>

namespace attnserve {

/// Memory LibTorch's caching allocator holds on one CUDA device.
struct DeviceMemory {
  int64_t allocated = 0;  ///< Bytes in live tensors.
  int64_t reserved = 0;   ///< Bytes held from the driver (allocated + cached).
};

/// True when attnserve was built against a CUDA LibTorch.
bool BuiltWithCuda();

/// Reads device `index`'s allocator statistics; false in builds without CUDA. Thread-safe.
bool ReadDeviceMemory(int index, DeviceMemory* out);

/// Returns cached, unused device memory to the driver (after an out-of-memory); a no-op without
/// CUDA. Thread-safe.
void ReleaseCachedDeviceMemory();

}  // namespace attnserve
