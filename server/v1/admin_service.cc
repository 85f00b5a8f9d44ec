#include "server/v1/admin_service.h"

#include <iostream>

#include "server/core/files.h"
#include "server/grpc/grpc_call.h"
#include "server/grpc/grpc_status.h"

namespace attnserve {
namespace {

constexpr uint64_t kMaxTokenBytes = 4096;

StatusOr<std::string> ReadToken(const std::string& path) {
  StatusOr<std::string> text = ReadFile(path, kMaxTokenBytes);
  if (!text.ok()) return text.status();
  std::string token = *text;
  const auto space = " \t\r\n";
  token.erase(0, token.find_first_not_of(space));
  token.erase(token.find_last_not_of(space) + 1);
  if (token.empty()) return Status(StatusCode::kFailedPrecondition, path + ": empty (no token)");
  return token;
}

// Compares in a time that depends on the token's length only, not on where the values differ.
bool SameSecret(const std::string& given, const std::string& token) {
  unsigned char diff = given.size() != token.size() ? 1 : 0;
  for (size_t i = 0; i < token.size(); ++i) {
    diff |= static_cast<unsigned char>((i < given.size() ? given[i] : 0) ^ token[i]);
  }
  return diff == 0;
}

}  // namespace

Status AdminAuth::Check(bool mutual_tls) const {
  if (!client_names.empty() && !mutual_tls) {
    return Status(
        StatusCode::kFailedPrecondition,
        "--admin-client-names: needs mutual TLS (--tls-cert, --tls-key and --tls-client-ca), "
        "which verifies client certificates");
  }
  if (!token_file.empty()) {
    StatusOr<std::string> token = ReadToken(token_file);
    if (!token.ok()) {
      return Status(StatusCode::kFailedPrecondition,
                    "--admin-token-file " + token.status().message());
    }
  }
  return Status();
}

Status AuthorizeAdmin(const AdminAuth& auth, const grpc::CallbackServerContext& ctx) {
  if (auth.token_file.empty() && auth.client_names.empty()) {
    return Status(StatusCode::kPermissionDenied,
                  "admin calls are disabled on this server: start it with --admin-token-file or "
                  "--admin-client-names (SIGHUP reloads the models without either)");
  }
  // A verified client certificate (mutual TLS) with an administrator's name.
  std::string cert_name;
  const std::shared_ptr<const grpc::AuthContext> peer = ctx.auth_context();
  if (peer && peer->IsPeerAuthenticated() && !auth.client_names.empty()) {
    for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
      for (const grpc::string_ref& value : peer->FindPropertyValues(property)) {
        const std::string name(value.begin(), value.end());
        if (cert_name.empty()) cert_name = name;
        for (const std::string& allowed : auth.client_names) {
          if (name == allowed) return Status();
        }
      }
    }
  }
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find("authorization");
  if (it != metadata.end()) {
    const std::string value(it->second.begin(), it->second.end());
    if (auth.token_file.empty()) {
      return Status(StatusCode::kUnauthenticated,
                    "authorization: this server takes no admin token (no --admin-token-file); "
                    "administrators are named by their client certificate (--admin-client-names)");
    }
    StatusOr<std::string> token = ReadToken(auth.token_file);
    if (!token.ok()) {
      std::cerr << "attnserve: admin call refused: --admin-token-file " << token.status().message()
                << "\n";
      return Status(StatusCode::kPermissionDenied,
                    "authorization: the server cannot read its --admin-token-file (see its log)");
    }
    const std::string kBearer = "Bearer ";
    if (value.compare(0, kBearer.size(), kBearer) != 0) {
      return Status(
          StatusCode::kUnauthenticated,
          "authorization: expected 'Bearer <token>', got a value not starting with 'Bearer '");
    }
    if (SameSecret(value.substr(kBearer.size()), *token)) return Status();
    return Status(StatusCode::kUnauthenticated,
                  "authorization: the token does not match the server's --admin-token-file");
  }
  if (!cert_name.empty()) {
    return Status(
        StatusCode::kPermissionDenied,
        "client certificate '" + cert_name + "' is not an administrator (--admin-client-names)");
  }
  return Status(
      StatusCode::kUnauthenticated,
      std::string("no admin credentials: ") +
          (auth.token_file.empty() ? "" : "send 'authorization: Bearer <token>' metadata") +
          (auth.token_file.empty() || auth.client_names.empty() ? "" : ", or ") +
          (auth.client_names.empty()
               ? ""
               : "present a client certificate named in --admin-client-names"));
}

AdminServiceImpl::AdminServiceImpl(ModelRepository& models, CallCounter& calls, AdminAuth auth,
                                   std::function<Status()> reload_first)
    : models_(models),
      calls_(calls),
      auth_(std::move(auth)),
      reload_first_(std::move(reload_first)) {}

grpc::ServerUnaryReactor* AdminServiceImpl::ReloadModels(grpc::CallbackServerContext* ctx,
                                                         const v1::ReloadModelsRequest*,
                                                         v1::ReloadModelsResponse* resp) {
  CountedUnaryReactor* reactor = NewUnaryReactor(calls_, ctx);
  const Status allowed = AuthorizeAdmin(auth_, *ctx);
  if (!allowed.ok()) {
    reactor->Answer(ToGrpcStatus(allowed));
    return reactor;
  }
  if (reload_first_) {
    const Status first = reload_first_();
    if (!first.ok()) {
      reactor->Answer(ToGrpcStatus(
          Status(first.code(), "reload refused, nothing changed: " + first.message())));
      return reactor;
    }
  }
  // Answered from the reloading thread once a reload that started after this call is done.
  models_.RequestReload([reactor, resp](const ReloadReport& report) {
    if (!report.status.ok()) {
      reactor->Answer(ToGrpcStatus(report.status));
      return;
    }
    for (const RepositoryChange& c : report.changes) {
      v1::ModelChange* out = resp->add_changes();
      out->set_name(c.name);
      out->set_version(c.version);
      switch (c.action) {
        case RepositoryChange::Action::kLoaded:
          out->set_action(v1::ModelChange::ACTION_LOADED);
          break;
        case RepositoryChange::Action::kUpdated:
          out->set_action(v1::ModelChange::ACTION_UPDATED);
          break;
        case RepositoryChange::Action::kUnloaded:
          out->set_action(v1::ModelChange::ACTION_UNLOADED);
          break;
        case RepositoryChange::Action::kFailed:
          out->set_action(v1::ModelChange::ACTION_FAILED);
          break;
      }
      out->set_weights_hash(c.weights_hash);
      out->set_message(c.message);
    }
    resp->set_models_served(report.models_served);
    reactor->Answer(grpc::Status::OK);
  });
  return reactor;
}

}  // namespace attnserve
