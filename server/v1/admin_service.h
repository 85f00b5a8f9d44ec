#pragma once

#include <string>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/core/status.h"
#include "server/grpc/call_counter.h"
#include "server/models/model_repository.h"

namespace attnserve {

/// Who may call AdminService (docs/models.md "Model lifecycle"). Neither set: nobody (SIGHUP still
/// reloads).
struct AdminAuth {
  /// A file holding a secret token; callers send `authorization: Bearer <token>` metadata. Read at
  /// each admin call, so a rotated file applies at once.
  std::string token_file;
  /// Client certificate names (subject CN or a subject alternative name) that are administrators;
  /// needs mutual TLS (--tls-client-ca), which verifies the certificates.
  std::vector<std::string> client_names;

  /// FAILED_PRECONDITION naming the flag when the token file is unusable at start-up.
  Status Check(bool mutual_tls) const;
};

/// Decides one admin call from its peer and metadata: OK, UNAUTHENTICATED (no or wrong
/// credentials) or PERMISSION_DENIED (credentials that are not an administrator's; admin disabled).
Status AuthorizeAdmin(const AdminAuth& auth, const grpc::CallbackServerContext& ctx);

/// attnserve.v1.AdminService on the callback API. Thread-safe; borrows the repository and the count
/// of calls open.
class AdminServiceImpl final : public v1::AdminService::CallbackService {
 public:
  /// `reload_first`, when given, runs before each reload of the models (the tenants file): its
  /// failure answers the call and nothing is reloaded.
  AdminServiceImpl(ModelRepository& models, CallCounter& calls, AdminAuth auth,
                   std::function<Status()> reload_first = nullptr);

  grpc::ServerUnaryReactor* ReloadModels(grpc::CallbackServerContext* ctx,
                                         const v1::ReloadModelsRequest* req,
                                         v1::ReloadModelsResponse* resp) override;

 private:
  ModelRepository& models_;
  CallCounter& calls_;
  const AdminAuth auth_;
  const std::function<Status()> reload_first_;
};

}  // namespace attnserve
