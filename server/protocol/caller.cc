#include "server/protocol/caller.h"

namespace attnserve {

StatusOr<std::string> TenantOfCall(const std::vector<std::string>& certificate_names,
                                   const std::string& tenant_header,
                                   const std::vector<std::string>& header_values,
                                   const std::string& what) {
  for (const std::string& name : certificate_names) {
    if (ValidTenantName(name)) return name;
  }
  if (tenant_header.empty() || header_values.empty()) return std::string(kDefaultTenant);
  // Exactly one valid value: a request carrying two cannot say which is meant, and one that names
  // nobody must not become "default" (and reach default's sessions).
  const std::string allowed =
      "; allowed: exactly one value of 1 to 128 printable ASCII characters without spaces";
  if (header_values.size() > 1) {
    return InvalidArgument(what + ": " + std::to_string(header_values.size()) + " values" +
                           allowed);
  }
  const std::string& name = header_values.front();
  if (!ValidTenantName(name)) {
    return InvalidArgument(what + ": a value of " + std::to_string(name.size()) +
                           " bytes that names no tenant" + allowed);
  }
  return name;
}

TenantRegions RegionsOf(SharedMemoryRegistry& shm, const CallContext& call,
                        const RequestPipeline& pipeline) {
  const std::shared_ptr<const Tenants> tenants = pipeline.tenants();
  const TenantPolicy& policy = tenants->Of(call.tenant);
  RegionTerms terms;
  terms.max_bytes = policy.shared_memory_max_bytes;
  terms.max_regions = policy.shared_memory_max_regions;
  StatusOr<std::string> prefix = SharedMemoryKeyPrefix(policy, call.tenant);
  if (prefix.ok()) {
    terms.key_prefix = std::move(prefix).value();
    if (!terms.key_prefix.empty()) terms.others_prefixes = tenants->KeyPrefixesBeside(call.tenant);
  } else {
    terms.keys_refused = prefix.status();
  }
  return shm.For(RegionCaller{call.tenant, std::move(terms), call.local_peer, call.peer_uri});
}

}  // namespace attnserve
