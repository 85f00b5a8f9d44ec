#pragma once
// Who calls and what they may reach, in no transport's terms: what every front end (gRPC, HTTP)
// asks of a call the same way, so a tenant is named and bounded alike whichever door it came in.

#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/pipeline/calls.h"
#include "server/pipeline/request_pipeline.h"
#include "server/shm/shared_memory.h"

namespace attnserve {

/// Who is calling (docs/tenants.md): the first of `certificate_names` (a verified client
/// certificate's common name, then its subject alternative names) that is a tenant's name; else,
/// only when the server trusts one (`tenant_header`, --tenant-header, "" for none), that header's
/// value (`header_values`: every value the call carries under it); else "default". A trusted
/// header that is present but does not name a tenant (two values, empty, over 128 characters, a
/// space or a control character) is INVALID_ARGUMENT naming `what` (say "metadata 'x-tenant'"),
/// never "default".
StatusOr<std::string> TenantOfCall(const std::vector<std::string>& certificate_names,
                                   const std::string& tenant_header,
                                   const std::vector<std::string>& header_values,
                                   const std::string& what);

/// The shared-memory regions `call`'s tenant may name, on its terms (the tenants file's
/// shared_memory_max_bytes and shared_memory_key_prefix), from its host or not.
TenantRegions RegionsOf(SharedMemoryRegistry& shm, const CallContext& call,
                        const RequestPipeline& pipeline);

}  // namespace attnserve
