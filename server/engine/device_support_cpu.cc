// CPU-only LibTorch: no device memory to report or release, no device work to time.
#include "server/engine/device_support.h"

namespace attnserve {

bool BuiltWithCuda() { return false; }
bool ReadDeviceMemory(int, DeviceMemory*) { return false; }
void ReleaseCachedDeviceMemory() {}
bool MeasureCopyBandwidth(int, int64_t, CopyBandwidth*) { return false; }

std::shared_ptr<void> AllocatePinned(size_t, char** data) {
  *data = nullptr;
  return nullptr;
}

struct DeviceTimer::Events {};
DeviceTimer::DeviceTimer(bool) {}
DeviceTimer::~DeviceTimer() = default;
double DeviceTimer::Seconds() { return -1; }

}  // namespace attnserve
