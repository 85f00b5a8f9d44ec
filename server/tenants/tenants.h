#pragma once
// Who shares the server and on what terms: the tenants file (--tenants). No gRPC, no LibTorch; the
// front ends say who is calling, the batcher, the key/value store and the shared-memory regions
// apply the terms (docs/tenants.md).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "server/core/status.h"

namespace attnserve {

/// The name of calls that name no tenant, and of the tenants file's entry for tenants it does not
/// name.
inline constexpr const char* kDefaultTenant = "default";

/// One tenant's terms.
struct TenantPolicy {
  /// Its share of the compute against the others' while both wait (> 0).
  double weight = 1;
  /// Its requests queued at once; beyond: RESOURCE_EXHAUSTED naming it. 0: no bound of its own.
  int64_t max_queued_requests = 0;
  /// Kept keys and values (memories, sessions) it holds that no other tenant's pressure evicts.
  int64_t kv_guaranteed_bytes = 0;
  /// The most it may hold; beyond: RESOURCE_EXHAUSTED naming it. 0: the store's budget.
  int64_t kv_max_bytes = 0;
  /// The most urgent priority level its requests are queued at (1 is the most urgent); one that
  /// asks for a more urgent level is queued at this one (PriorityOptions::LevelOf). 0: no cap.
  int64_t best_priority_level = 0;
  /// The most bytes of shared-memory regions it may have registered at once. 0: only the server's
  /// --shared-memory-bytes applies.
  int64_t shared_memory_max_bytes = 0;
  /// What the POSIX shared-memory keys it registers must start with, after the optional leading
  /// '/'; "{tenant}" stands for the caller's name (SharedMemoryKeyPrefix). "": any key.
  /// Every "{tenant}" in it is followed by '.'.
  std::string shared_memory_key_prefix;
  /// The most shared-memory regions it may have registered at once. 0: only the server's count.
  int64_t shared_memory_max_regions = 0;
};

/// `terms.shared_memory_key_prefix` with every "{tenant}" replaced by `tenant`: what the keys
/// `tenant` registers must start with ("" for any key). PERMISSION_DENIED when the prefix names
/// the tenant and the name holds anything but letters, digits, '_' and '-' (a '.' in it would make
/// one tenant's prefix the start of another's: "a." of "a.b."'s keys).
StatusOr<std::string> SharedMemoryKeyPrefix(const TenantPolicy& terms, const std::string& tenant);

/// The tenants file: {"default": {...}, "tenants": {"NAME": {...}}}; every key optional, each
/// entry's keys those of TenantPolicy. Tenants it does not name get `default`'s terms, each on its
/// own (its own share, its own K/V accounts, its own shared-memory key prefix).
class Tenants {
 public:
  Tenants() = default;
  /// Reads `path` (at most 1 MiB): FAILED_PRECONDITION naming the file and the field at fault.
  static StatusOr<std::shared_ptr<const Tenants>> Load(const std::string& path);
  static StatusOr<std::shared_ptr<const Tenants>> Parse(const std::string& text,
                                                        const std::string& where);
  /// FAILED_PRECONDITION when the guarantees (every named tenant's and the default's) add up to
  /// more than the store's budget (--kv-budget-bytes).
  Status CheckAgainst(int64_t kv_budget_bytes) const;

  const TenantPolicy& Of(const std::string& tenant) const;
  /// The key prefixes of the named tenants other than `tenant` (expanded, non-empty): a key that
  /// starts with one of them longer than `tenant`'s own is theirs, not `tenant`'s.
  std::vector<std::string> KeyPrefixesBeside(const std::string& tenant) const;
  /// The metrics label of `tenant`: its name when the file names it or it is "default", else
  /// "other" (so the label set stays bounded).
  std::string Label(const std::string& tenant) const;
  /// The labels there are: "default", the named tenants, "other".
  std::vector<std::string> Labels() const;
  const std::string& source() const { return source_; }

 private:
  TenantPolicy default_;
  std::map<std::string, TenantPolicy> named_;
  std::string source_;  // The file, or "" for none.
};

/// Whether `name` can name a tenant: 1 to 128 printable ASCII characters without spaces.
bool ValidTenantName(const std::string& name);

}  // namespace attnserve
