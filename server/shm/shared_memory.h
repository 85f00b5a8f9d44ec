#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "server/core/status.h"

namespace attnserve {

/// How clients on the same host may hand the server memory (server flags).
struct SharedMemoryOptions {
  /// Off unless --allow-shared-memory: a registration lets a local process give the server
  /// memory to read and write.
  bool allowed = false;
  /// Most bytes registered at once, over every region (--shared-memory-bytes).
  int64_t max_bytes = int64_t{16} << 30;
  /// Most regions registered at once.
  size_t max_regions = 1024;
  /// Owners, besides the server's own uid, whose objects may be registered (--shared-memory-uids).
  /// An object of any other uid is refused: a caller names a key, and the server (root, say) must
  /// not read or write an object its owner never offered.
  std::vector<uint32_t> allowed_uids;
  /// Told the bytes and regions registered after every change (for metrics); may be empty.
  std::function<void(int64_t bytes, size_t regions)> on_change;
};

/// What a region holds, for the Status calls and metrics.
struct RegionInfo {
  std::string name;
  std::string key;      ///< System regions: the POSIX shared memory key, as registered.
  bool cuda = false;    ///< A CUDA region (IPC handle) rather than system memory.
  int64_t device = -1;  ///< CUDA regions: the device.
  uint64_t offset = 0;  ///< System regions: where the window starts in the object.
  uint64_t byte_size = 0;
};

/// One registered region: a window of a POSIX shared memory object (or of a CUDA allocation
/// another process exported). A system region is read and written through its file descriptor
/// (pread/pwrite), never mapped: a file cut short underneath gives a short read, an error, never
/// SIGBUS, and the server's address space holds none of it. Held by every request that uses it:
/// unregistered meanwhile, it stays open until the last such request is done. Thread-safe.
class SharedRegion {
 public:
  virtual ~SharedRegion() = default;
  const RegionInfo& info() const { return info_; }

  /// Checks that [offset, offset + size) lies in the window (int64 overflow included):
  /// INVALID_ARGUMENT naming `what` (the request's field), the region's name and its size.
  Status Check(int64_t offset, int64_t size, const std::string& what) const;
  /// Copies `size` bytes at `offset` of the window into `dst` (Check first). A region whose
  /// object is now shorter than the bytes asked: FAILED_PRECONDITION saying so.
  virtual Status Read(int64_t offset, int64_t size, char* dst, const std::string& what) const = 0;
  /// Copies `size` bytes from `src` to `offset` of the window (Check first; a shortened object:
  /// FAILED_PRECONDITION, and nothing is written past its end).
  virtual Status Write(int64_t offset, const char* src, int64_t size,
                       const std::string& what) const = 0;

 protected:
  explicit SharedRegion(RegionInfo info) : info_(std::move(info)) {}
  RegionInfo info_;
};

/// A tensor's place in a registered region: `byte_size` bytes at `offset` of its window (checked
/// against it), the region held for as long as the reference is.
struct RegionRef {
  std::shared_ptr<const SharedRegion> region;
  int64_t offset = 0, byte_size = 0;
};

/// Opens a CUDA region from its IPC handle (device_support_cuda.cc where attnserve has CUDA); the
/// registry holds what it returns. Null: this build or machine has no CUDA.
using CudaRegionOpener = std::function<StatusOr<std::unique_ptr<SharedRegion>>(
    const RegionInfo& info, const std::string& raw_handle)>;

/// The regions clients registered, by name: one namespace for system and CUDA regions, as the
/// Open Inference Protocol's shared-memory extension has it. Thread-safe.
class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryOptions options, CudaRegionOpener cuda = nullptr);
  ~SharedMemoryRegistry();  ///< Closes every region not still held by a request.

  /// Registers [offset, offset + byte_size) of the POSIX shared memory object `key` ("/name": one
  /// leading slash optional, then letters, digits, '.', '_' and '-'; never a path) as `name`. The
  /// object is opened without blocking and without following a link: anything but a regular object
  /// (a FIFO, socket, device, directory) is INVALID_ARGUMENT at once, an object owned by another
  /// uid than the server's or SharedMemoryOptions::allowed_uids' PERMISSION_DENIED.
  /// Refused: shared memory off (FAILED_PRECONDITION naming --allow-shared-memory), a bad name or
  /// key, a window past the object's end or overflowing int64 (INVALID_ARGUMENT), the name
  /// registered already (ALREADY_EXISTS), the object missing (NOT_FOUND), the budget or the region
  /// count full (RESOURCE_EXHAUSTED). Messages name only what the caller gave.
  Status RegisterSystem(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);
  /// Registers a CUDA allocation exported by another process (cudaIpcGetMemHandle's bytes) on
  /// `device`, `byte_size` long. FAILED_PRECONDITION where there is no CUDA.
  Status RegisterCuda(const std::string& name, const std::string& raw_handle, int64_t device,
                      uint64_t byte_size);
  /// Unregisters `name` ("" = every region) of the kind given (system or CUDA); a name of the
  /// other kind is left alone. Requests using it finish with it. NOT_FOUND is never returned:
  /// unregistering what is not there succeeds, as Triton's does.
  Status Unregister(const std::string& name, bool cuda);
  /// The regions of one kind: all, or `name`'s (NOT_FOUND when it is not registered as that kind).
  StatusOr<std::vector<RegionInfo>> List(const std::string& name, bool cuda) const;
  /// The region a request names, held for as long as the request needs it. NOT_FOUND naming it
  /// (and only it) when it is not registered; FAILED_PRECONDITION when shared memory is off.
  StatusOr<std::shared_ptr<const SharedRegion>> Find(const std::string& name) const;

  /// Bytes and regions registered now.
  int64_t registered_bytes() const { return bytes_.load(); }
  size_t regions() const;
  bool allowed() const { return options_.allowed; }
  /// Whether CUDA regions can be registered (a CUDA server).
  bool cuda() const { return static_cast<bool>(cuda_); }
  const SharedMemoryOptions& options() const { return options_; }

  /// Unregisters everything (the server stops): regions still held close with their last request.
  void Clear();

 private:
  Status Admit(const std::string& name, uint64_t byte_size) const;  // Under mu_.
  void Changed() const;  // Tells options_.on_change (outside mu_).
  Status Add(std::unique_ptr<SharedRegion> region);

  const SharedMemoryOptions options_;
  const CudaRegionOpener cuda_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const SharedRegion>> regions_;
  std::atomic<int64_t> bytes_{0};
};

/// RESOURCE_EXHAUSTED unless `total` bytes of one request's inputs in regions are at most
/// `max_bytes` (--max-message-bytes: region inputs count as a message's bytes); checked before any
/// is read.
Status CheckRegionInputBytes(int64_t total, int64_t max_bytes);

/// Whether `key` is a POSIX shared memory key attnserve opens: "/name" or "name", the name 1 to 200
/// letters, digits, '.', '_' or '-', not "." or "..". Anything else (a path, a second slash) is
/// refused before any file is touched.
bool IsSharedMemoryKey(const std::string& key);

}  // namespace attnserve
