// Built only against a CUDA LibTorch (CMake: ATTNSERVE_CUDA). The rest of the engine reaches the
// GPU through c10's device-generic interfaces; the caching allocator's statistics and CUDA event
// timing have none.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <array>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <string>

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

std::shared_ptr<void> AllocatePinned(size_t bytes, char** data) {
  *data = nullptr;
  try {
    auto* tensor = new at::Tensor(at::empty(
        {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)));
    *data = static_cast<char*>(tensor->data_ptr());
    return std::shared_ptr<void>(tensor, [](void* t) { delete static_cast<at::Tensor*>(t); });
  } catch (const std::exception&) {
    return nullptr;
  }
}

std::unique_ptr<CudaIpcMemory> CudaIpcMemory::Open(const std::string& handle, int device,
                                                   std::string* error) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    *error = "raw_handle: " + std::to_string(handle.size()) + " bytes; a CUDA IPC handle has " +
             std::to_string(sizeof(cudaIpcMemHandle_t));
    return nullptr;
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof h);
  int previous = 0;
  cudaGetDevice(&previous);
  if (cudaSetDevice(device) != cudaSuccess) {
    *error = "device_id: " + std::to_string(device) + " is not a CUDA device here";
    cudaGetLastError();
    return nullptr;
  }
  void* base = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  cudaSetDevice(previous);
  if (e != cudaSuccess) {
    *error = std::string("raw_handle: CUDA cannot open it: ") + cudaGetErrorString(e);
    cudaGetLastError();
    return nullptr;
  }
  return std::unique_ptr<CudaIpcMemory>(new CudaIpcMemory(base, device));
}

CudaIpcMemory::~CudaIpcMemory() {
  if (base_ != nullptr) cudaIpcCloseMemHandle(base_);
}

bool CudaIpcMemory::CopyOut(int64_t offset, int64_t size, char* dst, std::string* error) const {
  const cudaError_t e = cudaMemcpy(dst, static_cast<char*>(base_) + offset,
                                   static_cast<size_t>(size), cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) return true;
  *error = cudaGetErrorString(e);
  return false;
}

bool CudaIpcMemory::CopyIn(int64_t offset, const char* src, int64_t size,
                           std::string* error) const {
  const cudaError_t e = cudaMemcpy(static_cast<char*>(base_) + offset, src,
                                   static_cast<size_t>(size), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) return true;
  *error = cudaGetErrorString(e);
  return false;
}

bool MeasureCopyBandwidth(int index, int64_t bytes, CopyBandwidth* out) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  const auto pinned = at::TensorOptions().dtype(at::kByte).pinned_memory(true);
  const auto device = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, index);
  const at::Tensor host_in = at::empty({bytes}, pinned), host_out = at::empty({bytes}, pinned);
  const at::Tensor dev_in = at::empty({bytes}, device), dev_out = at::empty({bytes}, device);
  const c10::cuda::CUDAStream in = c10::cuda::getStreamFromPool(false, index);
  const c10::cuda::CUDAStream back = c10::cuda::getStreamFromPool(false, index);
  const auto to_device = [&] {
    C10_CUDA_CHECK(cudaMemcpyAsync(dev_in.data_ptr(), host_in.data_ptr(), bytes,
                                   cudaMemcpyHostToDevice, in.stream()));
  };
  const auto to_host = [&] {
    C10_CUDA_CHECK(cudaMemcpyAsync(host_out.data_ptr(), dev_out.data_ptr(), bytes,
                                   cudaMemcpyDeviceToHost, back.stream()));
  };
  constexpr int kRepeats = 10;
  // Bytes per second of `copy` run kRepeats times (one unmeasured first).
  const auto rate = [&](const auto& copy) {
    copy();
    in.synchronize();
    back.synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kRepeats; ++i) copy();
    in.synchronize();
    back.synchronize();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return static_cast<double>(bytes) * kRepeats / s;
  };
  out->to_device = rate(to_device);
  out->to_host = rate(to_host);
  out->both = rate([&] {
    to_device();
    to_host();
  });
  return true;
}

namespace {
std::mutex profile_mu;
bool profiling = false;  // Guarded by profile_mu: one profile at a time in a process.

std::set<torch::profiler::impl::ActivityType> ProfiledActivities() {
  return {torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
}
}  // namespace

bool StartDeviceProfile(std::string* error) {
  std::lock_guard<std::mutex> lock(profile_mu);
  if (profiling) {
    *error = "a device profile is already running";
    return false;
  }
  try {
    const torch::profiler::impl::ProfilerConfig config(
        torch::profiler::impl::ProfilerState::KINETO);
    torch::autograd::profiler::prepareProfiler(config, ProfiledActivities());
    torch::autograd::profiler::enableProfiler(config, ProfiledActivities());
  } catch (const std::exception& e) {
    *error = std::string("LibTorch's profiler: ") + e.what();
    return false;
  }
  profiling = true;
  return true;
}

bool StopDeviceProfile(const std::string& path, std::string* error) {
  std::lock_guard<std::mutex> lock(profile_mu);
  if (!profiling) {
    *error = "no device profile is running";
    return false;
  }
  profiling = false;
  try {
    torch::autograd::profiler::disableProfiler()->save(path);
  } catch (const std::exception& e) {
    *error = "writing the device profile to " + path + ": " + e.what();
    return false;
  }
  return true;
}

struct DeviceTimer::Events {
  at::cuda::CUDAEvent start{cudaEventDefault};  // Timing events (the default flags disable timing).
  at::cuda::CUDAEvent stop{cudaEventDefault};
  std::array<std::unique_ptr<at::cuda::CUDAEvent>, DeviceTimer::kMarks> marks;
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

void DeviceTimer::Mark(int mark) {
  if (!events_ || mark < 0 || mark >= kMarks) return;
  auto& event = events_->marks[static_cast<size_t>(mark)];
  event = std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault);
  event->record(c10::cuda::getCurrentCUDAStream());
}

double DeviceTimer::Between(int from, int to) const {
  if (!events_ || from < 0 || to < 0 || from >= kMarks || to >= kMarks) return -1;
  const auto& a = events_->marks[static_cast<size_t>(from)];
  const auto& b = events_->marks[static_cast<size_t>(to)];
  if (!a || !b) return -1;
  return a->elapsed_time(*b) / 1e3;
}

}  // namespace attnserve
