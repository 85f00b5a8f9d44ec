// CPU-only LibTorch: no device memory to report or release.
#include "server/engine/device_support.h"

namespace attnserve {

bool BuiltWithCuda() { return false; }
bool ReadDeviceMemory(int, DeviceMemory*) { return false; }
void ReleaseCachedDeviceMemory() {}

}  // namespace attnserve
