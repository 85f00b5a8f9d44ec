#include "server/process/cuda_regions.h"

#include "server/engine/device_support.h"

namespace attnserve {
namespace {

// A CUDA region: another process's allocation, opened through its IPC handle; reads and writes
// are copies between it and host memory.
class CudaRegion final : public SharedRegion {
 public:
  CudaRegion(RegionInfo info, std::unique_ptr<CudaIpcMemory> memory)
      : SharedRegion(std::move(info)), memory_(std::move(memory)) {}
  Status Read(int64_t offset, int64_t size, char* dst, const std::string& what) const override {
    RETURN_IF_ERROR(Check(offset, size, what));
    std::string error;
    if (memory_->CopyOut(offset, size, dst, &error)) return Status::Ok();
    return Status(StatusCode::kFailedPrecondition,
                  what + ": reading CUDA shared memory region '" + info_.name + "': " + error);
  }
  Status Write(int64_t offset, const char* src, int64_t size,
               const std::string& what) const override {
    RETURN_IF_ERROR(Check(offset, size, what));
    std::string error;
    if (memory_->CopyIn(offset, src, size, &error)) return Status::Ok();
    return Status(StatusCode::kFailedPrecondition,
                  what + ": writing CUDA shared memory region '" + info_.name + "': " + error);
  }

 private:
  std::unique_ptr<CudaIpcMemory> memory_;
};

}  // namespace

CudaRegionOpener CudaRegions(const std::string& device) {
  if (device.rfind("cuda", 0) != 0) return nullptr;
  return [](const RegionInfo& info,
            const std::string& handle) -> StatusOr<std::unique_ptr<SharedRegion>> {
    std::string error;
    std::unique_ptr<CudaIpcMemory> memory =
        CudaIpcMemory::Open(handle, static_cast<int>(info.device), &error);
    if (!memory) return Status(StatusCode::kInvalidArgument, error);
    return std::unique_ptr<SharedRegion>(new CudaRegion(info, std::move(memory)));
  };
}

}  // namespace attnserve
