#pragma once
// Who shares the server and on what terms: the tenants file (--tenants). No gRPC, no LibTorch; the
// front ends say who is calling, the batcher and the key/value store apply the terms
// (docs/tenants.md).

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
};

/// The tenants file: {"default": {...}, "tenants": {"NAME": {...}}}; every key optional, each
/// entry's keys weight, max_queued_requests, kv_guaranteed_bytes, kv_max_bytes. Tenants it does
/// not name get `default`'s terms, each on its own (its own share and its own K/V accounts).
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
