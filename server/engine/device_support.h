#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

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

/// A block of `bytes` of page-locked host memory from LibTorch's caching host allocator (blocks
/// are kept for reuse once freed: pinning fresh memory costs milliseconds); `*data` is its first
/// byte. nullptr in builds without CUDA or when it cannot be had. Thread-safe.
std::shared_ptr<void> AllocatePinned(size_t bytes, char** data);

/// Host-device copy bandwidth between pinned host memory and device `index`, in bytes per second:
/// each way alone, and each way while both run at once (a GPU copies both ways concurrently).
struct CopyBandwidth {
  double to_device = 0, to_host = 0, both = 0;
};

/// Measures CopyBandwidth with copies of `bytes` (ten each, after one unmeasured); false in
/// builds without CUDA. For benchmarks: it occupies the bus while it runs.
bool MeasureCopyBandwidth(int index, int64_t bytes, CopyBandwidth* out);

/// LibTorch's profiler (Kineto) for benchmarks' evidence: from StartDeviceProfile until
/// StopDeviceProfile, the calling thread's operators and every CUDA kernel and copy (CUPTI),
/// written by Stop as a Chrome trace (chrome://tracing, Perfetto) to `path`. False with `*error`
/// saying why (a build without CUDA, a profiler already running, a file that cannot be written).
bool StartDeviceProfile(std::string* error);
bool StopDeviceProfile(const std::string& path, std::string* error);

/// A CUDA allocation another process exported with cudaIpcGetMemHandle, opened in this one (the
/// Open Inference Protocol's CUDA shared memory). Closed when destroyed. Thread-safe.
class CudaIpcMemory {
 public:
  /// Opens `handle` (cudaIpcMemHandle_t's bytes) on `device`; null with `*error` saying why (a
  /// handle of the wrong size, a build or machine without CUDA, the driver's refusal).
  static std::unique_ptr<CudaIpcMemory> Open(const std::string& handle, int device,
                                             std::string* error);
  ~CudaIpcMemory();
  /// Copies `size` bytes at `offset` of the allocation to host memory `dst`, or from `src`
  /// (synchronous). False with `*error` on the driver's refusal.
  bool CopyOut(int64_t offset, int64_t size, char* dst, std::string* error) const;
  bool CopyIn(int64_t offset, const char* src, int64_t size, std::string* error) const;

 private:
  CudaIpcMemory(void* base, int device) : base_(base), device_(device) {}
  void* base_;
  int device_;
};

/// Times the work a thread queues on its current CUDA stream with a pair of CUDA events: made
/// before the work, Seconds() after it (waits for the work to finish). Without CUDA it measures
/// nothing and Seconds() returns -1.
class DeviceTimer {
 public:
  explicit DeviceTimer(bool cuda);
  ~DeviceTimer();
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;
  double Seconds();
  /// Records point `mark` (0 .. kMarks - 1) of the work queued on the stream so far.
  static constexpr int kMarks = 4;
  void Mark(int mark);
  /// After Seconds(): device time from point `from` to point `to`; -1 when either was not recorded.
  double Between(int from, int to) const;

 private:
  struct Events;
  std::unique_ptr<Events> events_;
};

}  // namespace attnserve
