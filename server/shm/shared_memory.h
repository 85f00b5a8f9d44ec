#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
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
  /// Whether a caller that is not on this host (a peer off loopback and not on a unix socket) may
  /// register (--shared-memory-remote-peers). Off: such a registration is PERMISSION_DENIED, since
  /// the object it names is on the server's host, not on the caller's.
  bool remote_peers = false;
  /// Told the bytes and regions registered after every change (for metrics); may be empty.
  std::function<void(int64_t bytes, size_t regions)> on_change;
};

/// What one tenant may register (the tenants file's shared_memory_max_bytes and
/// shared_memory_key_prefix, docs/tenants.md).
struct RegionTerms {
  /// The most bytes its regions hold at once; 0: only the server's SharedMemoryOptions::max_bytes.
  int64_t max_bytes = 0;
  /// The most regions it holds at once; 0: only the server's SharedMemoryOptions::max_regions.
  int64_t max_regions = 0;
  /// The keys it may name start with this (after the optional '/'); "": any key.
  std::string key_prefix;
  /// Other tenants' prefixes: a key that starts with one longer than `key_prefix` is theirs.
  std::vector<std::string> others_prefixes;
  /// Not OK: this tenant may name no key at all (its name cannot stand in its prefix), and says
  /// why.
  Status keys_refused;
};

/// Who registers or names a region: the tenant (every name is that tenant's own), its terms, and
/// whether its call came from this host.
struct RegionCaller {
  std::string tenant;
  RegionTerms terms;
  bool local = true;
  /// The call's peer in gRPC's form ("ipv4:127.0.0.1:5000"; "" when not known): on loopback TCP,
  /// what finds the uid of the process that made the call (SocketOwnerOf).
  std::string peer_uri;
};

/// What a region holds, for the Status calls and metrics.
struct RegionInfo {
  std::string name;
  std::string key;       ///< System regions: the POSIX shared memory key, as registered.
  bool cuda = false;     ///< A CUDA region (IPC handle) rather than system memory.
  bool writable = true;  ///< System regions: false when its object's mode lets its owner only read.
  int64_t device = -1;   ///< CUDA regions: the device.
  uint64_t offset = 0;   ///< System regions: where the window starts in the object.
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
  /// FAILED_PRECONDITION naming `what` (an output's field) when answers cannot be written into the
  /// region (its object is read-only to its owner): said before anything is computed.
  Status CheckWritable(const std::string& what) const;
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

class SharedMemoryRegistry;

/// One caller's regions: the only way to a region's name. Made by SharedMemoryRegistry::For for
/// the caller of one call (its tenant, its terms, whether it is on this host). Every name it takes
/// and gives is that tenant's own: another tenant's regions are not there at all (NOT_FOUND exactly
/// as a name never registered; never listed, never unregistered, "" unregisters only this
/// tenant's), and two tenants may use the same name. So no handler can reach another tenant's
/// region: it has no name for it. Cheap to make; valid while its registry is.
class TenantRegions {
 public:
  /// Registers [offset, offset + byte_size) of the POSIX shared memory object `key` ("/name": one
  /// leading slash optional, then letters, digits, '.', '_' and '-'; never a path) as `name`. The
  /// object is opened without blocking and without following a link: anything but a regular object
  /// (a FIFO, socket, device, directory) is INVALID_ARGUMENT at once, an object owned by another
  /// uid than the server's or SharedMemoryOptions::allowed_uids' PERMISSION_DENIED, a key outside
  /// the tenant's RegionTerms::key_prefix PERMISSION_DENIED, a caller not on this host
  /// PERMISSION_DENIED (unless SharedMemoryOptions::remote_peers).
  /// Refused: shared memory off (FAILED_PRECONDITION naming --allow-shared-memory), a bad name or
  /// key, a window past the object's end or overflowing int64 (INVALID_ARGUMENT), the name
  /// registered already by this tenant (ALREADY_EXISTS), the object missing (NOT_FOUND), the
  /// tenant's cap, the server's budget or region count full (RESOURCE_EXHAUSTED: the tenant's own
  /// bytes named, never another's). Messages name only what the caller gave.
  Status RegisterSystem(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size) const;
  /// Registers a CUDA allocation exported by another process (cudaIpcGetMemHandle's bytes) on
  /// `device`, `byte_size` long. FAILED_PRECONDITION where there is no CUDA.
  Status RegisterCuda(const std::string& name, const std::string& raw_handle, int64_t device,
                      uint64_t byte_size) const;
  /// Unregisters this tenant's `name` ("" = every region of this tenant) of the kind given (system
  /// or CUDA); a name of the other kind is left alone. Requests using it finish with it. NOT_FOUND
  /// is never returned: unregistering what is not there succeeds, as Triton's does.
  Status Unregister(const std::string& name, bool cuda) const;
  /// This tenant's regions of one kind: all, or `name`'s (NOT_FOUND when it has none by that name
  /// of that kind).
  StatusOr<std::vector<RegionInfo>> List(const std::string& name, bool cuda) const;
  /// This tenant's region a request names, held for as long as the request needs it. NOT_FOUND
  /// naming it (and only it) when this tenant has none by that name; FAILED_PRECONDITION when
  /// shared memory is off.
  StatusOr<std::shared_ptr<const SharedRegion>> Find(const std::string& name) const;

 private:
  friend class SharedMemoryRegistry;
  TenantRegions(SharedMemoryRegistry& registry, RegionCaller caller)
      : registry_(&registry), caller_(std::move(caller)) {}
  SharedMemoryRegistry* registry_;
  RegionCaller caller_;
};

/// The regions clients registered: per tenant, by name (one namespace for system and CUDA regions
/// within a tenant, as the Open Inference Protocol's shared-memory extension has it). Reached only
/// through For(caller). Thread-safe.
class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryOptions options, CudaRegionOpener cuda = nullptr);
  ~SharedMemoryRegistry();  ///< Closes every region not still held by a request.

  /// `caller`'s view: its tenant's regions and nothing else.
  TenantRegions For(RegionCaller caller) { return TenantRegions(*this, std::move(caller)); }

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
  friend class TenantRegions;
  using Key = std::pair<std::string, std::string>;  // (tenant, name)
  // Who may register at all: shared memory on, the caller on this host, a good name.
  Status AdmitCaller(const RegionCaller& caller, const std::string& name) const;
  // Whether the region fits: the name free, the tenant's and the server's counts and bytes.
  // Checked last (once the key, its prefix and the object are), so that a caller learns of the
  // server's budget only with an object of its own in hand. Under mu_.
  Status AdmitRoom(const RegionCaller& caller, const std::string& name, uint64_t byte_size) const;
  void Changed() const;  // Tells options_.on_change (outside mu_).
  Status Add(const RegionCaller& caller, std::unique_ptr<SharedRegion> region);

  const SharedMemoryOptions options_;
  const CudaRegionOpener cuda_;
  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<const SharedRegion>> regions_;
  std::map<std::string, std::pair<int64_t, int64_t>> tenants_;  // Bytes, regions of those with any.
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
