#pragma once

#include <string>

#include "server/http/http_server.h"
#include "server/http/oip_json.h"
#include "server/protocol/oip_protocol.h"

namespace attnserve {

/// The Open Inference Protocol's HTTP/REST front end (docs/api.md "HTTP"): each route an adapter
/// onto OipProtocol and the RequestPipeline, so an HTTP call is validated, batched, limited,
/// counted (its method labelled "http/NAME") and drained exactly as the gRPC call it stands for.
/// Routes: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/M[/versions/V][/ready]; POST
/// /v2/models/M[/versions/V]/infer, /v2/repository/index; the system shared-memory extension
/// under /v2/systemsharedmemory. Thread-safe.
class OipHttp {
 public:
  /// Borrows `oip` (and its pipeline and regions). `version`: the server's, in its metadata.
  OipHttp(OipProtocol& oip, std::string version, JsonLimits limits = {});
  /// The HttpServer's handler.
  void Handle(HttpRequest&& request, HttpReply reply);

 private:
  // Each answers `reply` once.
  void Infer(HttpRequest&& request, const CallContext& call, const std::string& model,
             const std::string& version, HttpReply reply);
  void Model(const std::vector<std::string>& path, HttpReply reply);
  void SharedMemory(HttpRequest&& request, const std::vector<std::string>& path,
                    const CallContext& call, HttpReply reply);
  std::string RepositoryIndex() const;

  OipProtocol& oip_;
  const std::string version_;
  const JsonLimits limits_;
};

}  // namespace attnserve
