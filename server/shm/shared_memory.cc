#include "server/shm/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "server/core/checked_math.h"
#include "server/core/peer.h"

namespace attnserve {
namespace {

constexpr size_t kMaxNameBytes = 256;

Status Invalid(std::string m) { return InvalidArgument(std::move(m)); }

std::string Quoted(const std::string& s) { return "'" + s + "'"; }

// A region of a POSIX shared memory object, read and written through its descriptor.
class SystemRegion final : public SharedRegion {
 public:
  SystemRegion(RegionInfo info, int fd) : SharedRegion(std::move(info)), fd_(fd) {}
  ~SystemRegion() override { ::close(fd_); }

  Status Read(int64_t offset, int64_t size, char* dst, const std::string& what) const override {
    RETURN_IF_ERROR(Check(offset, size, what));
    const int64_t start = static_cast<int64_t>(info_.offset) + offset;
    for (int64_t done = 0; done < size;) {
      const ssize_t n = ::pread(fd_, dst + done, static_cast<size_t>(size - done), start + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Shortened(what, start + size);
      done += n;
    }
    return Status::Ok();
  }

  Status Write(int64_t offset, const char* src, int64_t size,
               const std::string& what) const override {
    RETURN_IF_ERROR(Check(offset, size, what));
    const int64_t start = static_cast<int64_t>(info_.offset) + offset;
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || st.st_size < start + size) return Shortened(what, start + size);
    for (int64_t done = 0; done < size;) {
      const ssize_t n = ::pwrite(fd_, src + done, static_cast<size_t>(size - done), start + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        return Status(StatusCode::kFailedPrecondition, what + ": writing shared memory region " +
                                                           Quoted(info_.name) +
                                                           " failed: " + std::strerror(errno));
      }
      done += n;
    }
    return Status::Ok();
  }

 private:
  Status Shortened(const std::string& what, int64_t end) const {
    struct stat st {};
    const int64_t now = ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
    return Status(StatusCode::kFailedPrecondition,
                  what + ": shared memory region " + Quoted(info_.name) +
                      " was cut short after it was registered: its object now holds " +
                      std::to_string(now) + " bytes, the request needs up to byte " +
                      std::to_string(end) + "; register it again");
  }
  const int fd_;
};

// Opens the POSIX shared memory object `key` (IsSharedMemoryKey) as shm_open would (its file
// under /dev/shm), in two steps: first only a reference to the file itself (O_PATH, no link
// followed: nothing is opened for reading or writing, so a FIFO or a device sees no open at all),
// checked to be a regular object of the server's uid or of one of `uids`, and of `caller_uid`
// where the call's uid is known; then that same file, through the reference, with its owner's
// rights by its mode (read-only without the owner's write bit, refused without the read bit),
// whatever rights the server's uid (root) would have. *fd and *st: the open descriptor and what
// fstat said of it.
Status OpenObject(const std::string& key, const std::vector<uint32_t>& uids,
                  std::optional<uint32_t> caller_uid, int* fd, struct stat* st) {
  const std::string file = "/dev/shm" + (key[0] == '/' ? key : "/" + key);
  const int path = ::open(file.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (path < 0) {
    const int err = errno;
    return Status(
        err == ENOENT ? StatusCode::kNotFound : StatusCode::kFailedPrecondition,
        "key: shared memory object " + Quoted(key) + " cannot be opened: " + std::strerror(err));
  }
  Status refused;
  if (::fstat(path, st) != 0) {
    refused = Status(StatusCode::kFailedPrecondition,
                     "key: shared memory object " + Quoted(key) + ": " + std::strerror(errno));
  } else if (!S_ISREG(st->st_mode)) {
    refused = Invalid("key: " + Quoted(key) +
                      " is not a regular shared memory object (a link, FIFO, socket, device or "
                      "directory); only objects made by shm_open are registered");
  } else if (st->st_uid != ::geteuid() &&
             std::find(uids.begin(), uids.end(), st->st_uid) == uids.end()) {
    refused = Status(StatusCode::kPermissionDenied,
                     "key: shared memory object " + Quoted(key) + " belongs to uid " +
                         std::to_string(st->st_uid) + ", not to this server's (" +
                         std::to_string(::geteuid()) +
                         ") nor to a uid the server's flag --shared-memory-uids lists");
  } else if (caller_uid && st->st_uid != *caller_uid) {
    refused = Status(
        StatusCode::kPermissionDenied,
        "key: shared memory object " + Quoted(key) + " belongs to uid " +
            std::to_string(st->st_uid) + ", and this call came from a process of uid " +
            std::to_string(*caller_uid) + "; a caller registers only objects of its own uid");
  } else if ((st->st_mode & S_IRUSR) == 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%03o", static_cast<unsigned>(st->st_mode & 0777));
    refused = Status(StatusCode::kPermissionDenied, "key: shared memory object " + Quoted(key) +
                                                        " has mode " + mode +
                                                        ": its owner may not read it");
  }
  if (!refused.ok()) {
    ::close(path);
    return refused;
  }
  // The very file checked above (the reference pins it: a rename or a new object under the same
  // key meanwhile changes nothing).
  const std::string self = "/proc/self/fd/" + std::to_string(path);
  constexpr int kFlags = O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
  const bool writable = (st->st_mode & S_IWUSR) != 0;
  *fd = ::open(self.c_str(), (writable ? O_RDWR : O_RDONLY) | kFlags);
  if (*fd < 0 && errno == EACCES && writable) *fd = ::open(self.c_str(), O_RDONLY | kFlags);
  const int err = errno;
  ::close(path);
  if (*fd < 0) {
    return Status(StatusCode::kFailedPrecondition, "key: shared memory object " + Quoted(key) +
                                                       " cannot be opened: " + std::strerror(err));
  }
  return Status::Ok();
}

}  // namespace

Status CheckRegionInputBytes(int64_t total, int64_t max_bytes) {
  if (total <= max_bytes) return Status::Ok();
  return Status(StatusCode::kResourceExhausted,
                "shared memory: the request's tensors in regions take " + std::to_string(total) +
                    " bytes in all; the server reads at most " + std::to_string(max_bytes) +
                    " of one request's inputs from regions, as much as one message may carry "
                    "(server flag --max-message-bytes)");
}

bool IsSharedMemoryKey(const std::string& key) {
  const std::string name = !key.empty() && key[0] == '/' ? key.substr(1) : key;
  if (name.empty() || name.size() > 200 || name == "." || name == "..") return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

Status SharedRegion::CheckWritable(const std::string& what) const {
  if (info_.writable) return Status::Ok();
  return Status(StatusCode::kFailedPrecondition,
                what + ": shared memory region " + Quoted(info_.name) +
                    " is read-only (its object's mode gives its owner no write permission); name "
                    "a writable region for an answer, or none");
}

Status SharedRegion::Check(int64_t offset, int64_t size, const std::string& what) const {
  const std::optional<int64_t> end = CheckedAdd(offset, size);
  if (offset < 0 || size < 0 || !end || static_cast<uint64_t>(*end) > info_.byte_size) {
    return Invalid(what + ": offset " + std::to_string(offset) + " and byte size " +
                   std::to_string(size) + " do not fit shared memory region " + Quoted(info_.name) +
                   " of " + std::to_string(info_.byte_size) + " bytes");
  }
  return Status::Ok();
}

SharedMemoryRegistry::SharedMemoryRegistry(SharedMemoryOptions options, CudaRegionOpener cuda)
    : options_(options), cuda_(std::move(cuda)) {}

SharedMemoryRegistry::~SharedMemoryRegistry() { Clear(); }

Status SharedMemoryRegistry::AdmitCaller(const RegionCaller& caller,
                                         const std::string& name) const {
  if (!options_.allowed) {
    return Status(StatusCode::kFailedPrecondition,
                  "shared memory is off on this server (start it with --allow-shared-memory to "
                  "let clients on its host register regions)");
  }
  if (!caller.local && !options_.remote_peers) {
    return Status(StatusCode::kPermissionDenied,
                  "shared memory: this call did not come from the server's host (loopback or a "
                  "unix socket), and a region names an object on the server's host; the server "
                  "flag --shared-memory-remote-peers allows it");
  }
  if (name.empty() || name.size() > kMaxNameBytes) {
    return Invalid("name: " + std::to_string(name.size()) + " bytes; expected 1 to " +
                   std::to_string(kMaxNameBytes));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) return Invalid("name: has a control character; expected text");
  }
  return Status::Ok();
}

Status SharedMemoryRegistry::AdmitRoom(const RegionCaller& caller, const std::string& name,
                                       uint64_t byte_size) const {
  if (regions_.count({caller.tenant, name})) {
    return Status(StatusCode::kAlreadyExists,
                  "name: shared memory region " + Quoted(name) +
                      " is registered already; unregister it first, or choose another name");
  }
  const auto held = tenants_.find(caller.tenant);
  const int64_t mine = held == tenants_.end() ? 0 : held->second.first;
  const int64_t count = held == tenants_.end() ? 0 : held->second.second;
  const RegionTerms& terms = caller.terms;
  if (terms.max_regions > 0 && count >= terms.max_regions) {
    return Status(StatusCode::kResourceExhausted,
                  "shared memory: this tenant has " + std::to_string(count) +
                      " regions registered, its most (tenants file, shared_memory_max_regions); "
                      "unregister some");
  }
  if (regions_.size() >= options_.max_regions) {
    return Status(StatusCode::kResourceExhausted,
                  "shared memory: this tenant has " + std::to_string(count) +
                      " regions registered, and the server holds at most " +
                      std::to_string(options_.max_regions) +
                      " over every tenant; unregister some, or retry later");
  }
  const int64_t cap = terms.max_bytes;
  if (byte_size == 0 || (cap > 0 && (byte_size > static_cast<uint64_t>(cap) ||
                                     static_cast<int64_t>(byte_size) > cap - mine))) {
    return Status(StatusCode::kResourceExhausted,
                  "byte_size: " + std::to_string(byte_size) + " bytes with the " +
                      std::to_string(mine) + " this tenant has registered would pass its " +
                      std::to_string(cap) +
                      " (tenants file, shared_memory_max_bytes); a region needs at least 1 byte");
  }
  if (byte_size > static_cast<uint64_t>(options_.max_bytes) ||
      static_cast<int64_t>(byte_size) > options_.max_bytes - bytes_.load()) {
    // Nothing of what others hold: only the caller's own bytes and the server's flag.
    return Status(StatusCode::kResourceExhausted,
                  "byte_size: " + std::to_string(byte_size) +
                      " bytes do not fit the server's shared memory budget now (flag "
                      "--shared-memory-bytes, " +
                      std::to_string(options_.max_bytes) + " over every tenant); this tenant has " +
                      std::to_string(mine) + " registered");
  }
  return Status::Ok();
}

Status SharedMemoryRegistry::Add(const RegionCaller& caller, std::unique_ptr<SharedRegion> region) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const RegionInfo& info = region->info();
    RETURN_IF_ERROR(AdmitRoom(caller, info.name, info.byte_size));
    bytes_ += static_cast<int64_t>(info.byte_size);
    auto& [bytes, count] = tenants_[caller.tenant];
    bytes += static_cast<int64_t>(info.byte_size);
    ++count;
    regions_.emplace(Key{caller.tenant, info.name}, std::move(region));
  }
  Changed();
  return Status::Ok();
}

void SharedMemoryRegistry::Changed() const {
  if (options_.on_change) options_.on_change(bytes_.load(), regions());
}

namespace {

// PERMISSION_DENIED unless `key` (its leading '/' aside) is the tenant's: it starts with the
// tenant's prefix and with no other tenant's longer one (which would make it theirs). The same
// message either way: a refusal does not tell which other prefixes there are.
Status CheckKeyPrefix(const std::string& key, const RegionTerms& terms) {
  RETURN_IF_ERROR(terms.keys_refused);
  const std::string name = key[0] == '/' ? key.substr(1) : key;
  const auto starts = [&name](const std::string& p) { return name.compare(0, p.size(), p) == 0; };
  bool mine = starts(terms.key_prefix);
  for (const std::string& other : terms.others_prefixes) {
    if (other.size() > terms.key_prefix.size() && starts(other)) mine = false;
  }
  if (mine) return Status::Ok();
  return Status(StatusCode::kPermissionDenied,
                "key: " + Quoted(key) + " is not one of this tenant's: its keys start with " +
                    Quoted(terms.key_prefix) + " (tenants file, shared_memory_key_prefix)");
}

}  // namespace

Status TenantRegions::RegisterSystem(const std::string& name, const std::string& key,
                                     uint64_t offset, uint64_t byte_size) const {
  RETURN_IF_ERROR(registry_->AdmitCaller(caller_, name));
  if (!IsSharedMemoryKey(key)) {
    return Invalid("key: " + Quoted(key) +
                   " is not a POSIX shared memory key; expected \"/name\" with letters, digits, "
                   "'.', '_' or '-' (never a path)");
  }
  RETURN_IF_ERROR(CheckKeyPrefix(key, caller_.terms));
  const std::optional<int64_t> end =
      offset > static_cast<uint64_t>(INT64_MAX) || byte_size > static_cast<uint64_t>(INT64_MAX)
          ? std::nullopt
          : CheckedAdd(static_cast<int64_t>(offset), static_cast<int64_t>(byte_size));
  if (!end) {
    return Invalid("offset: " + std::to_string(offset) + " plus byte_size " +
                   std::to_string(byte_size) + " overflows int64");
  }
  // On loopback TCP, the process that made the call is found by its socket (its connection's two
  // ends, then the client's end in the kernel's table): it registers only its own objects. A unix
  // socket's caller is whoever its file's mode lets connect.
  std::optional<uint32_t> caller_uid;
  if (caller_.local &&
      (caller_.peer_uri.rfind("ipv4:", 0) == 0 || caller_.peer_uri.rfind("ipv6:", 0) == 0)) {
    const std::optional<std::string> server_end =
        ConnectionEnds::Get().ServerEndOf(caller_.peer_uri);
    if (server_end) caller_uid = SocketOwnerOf(caller_.peer_uri, *server_end);
    if (!caller_uid) {
      return Status(StatusCode::kPermissionDenied,
                    "shared memory: the process that made this call (from " + caller_.peer_uri +
                        ") is not known: its connection is gone, shares its address with another, "
                        "or is not in this host's table of TCP sockets; a caller registers only "
                        "objects of its own uid");
    }
  }
  int fd = -1;
  struct stat st {};
  RETURN_IF_ERROR(OpenObject(key, registry_->options_.allowed_uids, caller_uid, &fd, &st));
  if (st.st_size < *end) {
    const int64_t size = static_cast<int64_t>(st.st_size);
    ::close(fd);
    return Invalid("byte_size: offset " + std::to_string(offset) + " plus byte_size " +
                   std::to_string(byte_size) + " is past the end of shared memory object " +
                   Quoted(key) + " (" + std::to_string(size) + " bytes)");
  }
  RegionInfo info;
  info.name = name;
  info.key = key;
  info.offset = offset;
  info.byte_size = byte_size;
  info.writable = (::fcntl(fd, F_GETFL) & O_ACCMODE) == O_RDWR;
  return registry_->Add(caller_, std::make_unique<SystemRegion>(std::move(info), fd));
}

Status TenantRegions::RegisterCuda(const std::string& name, const std::string& raw_handle,
                                   int64_t device, uint64_t byte_size) const {
  RETURN_IF_ERROR(registry_->AdmitCaller(caller_, name));
  if (!registry_->cuda_) {
    return Status(StatusCode::kFailedPrecondition,
                  "CUDA shared memory needs a server computing on a GPU (--device cuda)");
  }
  RegionInfo info;
  info.name = name;
  info.cuda = true;
  info.device = device;
  info.byte_size = byte_size;
  ASSIGN_OR_RETURN(std::unique_ptr<SharedRegion> region, registry_->cuda_(info, raw_handle));
  return registry_->Add(caller_, std::move(region));
}

Status TenantRegions::Unregister(const std::string& name, bool cuda) const {
  std::vector<std::shared_ptr<const SharedRegion>> gone;  // Closed outside the lock.
  {
    std::lock_guard<std::mutex> lock(registry_->mu_);
    auto& regions = registry_->regions_;
    for (auto it = regions.lower_bound({caller_.tenant, ""});
         it != regions.end() && it->first.first == caller_.tenant;) {
      if ((name.empty() || it->first.second == name) && it->second->info().cuda == cuda) {
        const auto bytes = static_cast<int64_t>(it->second->info().byte_size);
        registry_->bytes_ -= bytes;
        auto& [held, count] = registry_->tenants_[caller_.tenant];
        held -= bytes;
        if (--count == 0) registry_->tenants_.erase(caller_.tenant);
        gone.push_back(std::move(it->second));
        it = regions.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (!gone.empty()) registry_->Changed();
  return Status::Ok();
}

StatusOr<std::vector<RegionInfo>> TenantRegions::List(const std::string& name, bool cuda) const {
  std::lock_guard<std::mutex> lock(registry_->mu_);
  std::vector<RegionInfo> out;
  const auto& regions = registry_->regions_;
  for (auto it = regions.lower_bound({caller_.tenant, ""});
       it != regions.end() && it->first.first == caller_.tenant; ++it) {
    const RegionInfo& info = it->second->info();
    if ((name.empty() || it->first.second == name) && info.cuda == cuda) out.push_back(info);
  }
  if (!name.empty() && out.empty()) {
    return NotFound("name: no " + std::string(cuda ? "CUDA" : "system") + " shared memory region " +
                    Quoted(name) + " is registered");
  }
  return out;
}

StatusOr<std::shared_ptr<const SharedRegion>> TenantRegions::Find(const std::string& name) const {
  if (!registry_->options_.allowed) {
    return Status(StatusCode::kFailedPrecondition,
                  "shared memory is off on this server (--allow-shared-memory); send the "
                  "tensor's bytes in the message");
  }
  if (!caller_.local && !registry_->options_.remote_peers) {
    // The region names an object on this host; its tenant's calls from elsewhere do not reach it.
    return Status(StatusCode::kPermissionDenied,
                  "shared memory region " + Quoted(name) +
                      ": this call did not come from the server's host (loopback or a unix "
                      "socket), and a region names an object on the server's host; the server "
                      "flag --shared-memory-remote-peers allows it");
  }
  std::lock_guard<std::mutex> lock(registry_->mu_);
  auto it = registry_->regions_.find({caller_.tenant, name});
  if (it == registry_->regions_.end()) {
    return NotFound("shared memory region " + Quoted(name) + " is not registered");
  }
  return it->second;
}

size_t SharedMemoryRegistry::regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.size();
}

void SharedMemoryRegistry::Clear() {
  std::map<Key, std::shared_ptr<const SharedRegion>> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gone.swap(regions_);
    tenants_.clear();
    bytes_ = 0;
  }
  Changed();
}

}  // namespace attnserve
