// CPU-only LibTorch: no device memory to report or release, no device work to time.
#include <string>

#include "server/engine/device_support.h"

namespace attnserve {

bool BuiltWithCuda() { return false; }
bool ReadDeviceMemory(int, DeviceMemory*) { return false; }
void ReleaseCachedDeviceMemory() {}
bool MeasureCopyBandwidth(int, int64_t, CopyBandwidth*) { return false; }

bool StartDeviceProfile(std::string* error) {
  *error = "this build has no CUDA (the device profile is for GPU runs)";
  return false;
}
bool StopDeviceProfile(const std::string&, std::string* error) {
  *error = "no device profile is running";
  return false;
}

std::shared_ptr<void> AllocatePinned(size_t, char** data) {
  *data = nullptr;
  return nullptr;
}

std::unique_ptr<CudaIpcMemory> CudaIpcMemory::Open(const std::string&, int, std::string* error) {
  *error = "this attnserve is built without CUDA";
  return nullptr;
}
CudaIpcMemory::~CudaIpcMemory() = default;
bool CudaIpcMemory::CopyOut(int64_t, int64_t, char*, std::string* error) const {
  *error = "no CUDA";
  return false;
}
bool CudaIpcMemory::CopyIn(int64_t, const char*, int64_t, std::string* error) const {
  *error = "no CUDA";
  return false;
}

struct DeviceTimer::Events {};
DeviceTimer::DeviceTimer(bool) {}
DeviceTimer::~DeviceTimer() = default;
double DeviceTimer::Seconds() { return -1; }
void DeviceTimer::Mark(int) {}
double DeviceTimer::Between(int, int) const { return -1; }

}  // namespace attnserve
