#include "server/http/oip_http.h"

#include <nlohmann/json.hpp>

#include "server/core/caught.h"
#include "server/http/http_status.h"
#include "server/protocol/caller.h"
#include "server/trace/trace_context.h"

namespace attnserve {
namespace {

constexpr const char* kInferMethod = "http/ModelInfer";

HttpResponse Json(int code, std::string body) {
  HttpResponse r;
  r.code = code;
  r.head = std::move(body);
  return r;
}

// A failure as the protocol's {"error": "..."} with its HTTP code; a traced call names its trace.
HttpResponse Failure(const Status& st, const CallTrace& trace = {}) {
  HttpResponse r = Json(ToHttpCode(st.code()), JsonError(st.message()));
  if (trace.on) r.headers.emplace_back("attnserve-trace-id", Hex(trace.trace_id));
  return r;
}

std::vector<std::string> Segments(const std::string& path) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t slash = path.find('/', start);
    const size_t end = slash == std::string::npos ? path.size() : slash;
    if (end > start) out.push_back(path.substr(start, end - start));
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return out;
}

// What the pipeline needs of an HTTP call: its tenant (the trusted header), peer and trace. An
// HTTP call has no deadline of its own (a request's `timeout` parameter bounds its queueing).
StatusOr<CallContext> CallOf(const HttpRequest& r, const RequestPipeline& pipeline) {
  if (!pipeline.Published()) return Status(StatusCode::kUnavailable, "the server is starting");
  CallContext call;
  std::string header = pipeline.tenant_header();
  std::transform(header.begin(), header.end(), header.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  ASSIGN_OR_RETURN(call.tenant,
                   TenantOfCall(r.certificate_names, header,
                                header.empty() ? std::vector<std::string>{} : r.Values(header),
                                "header '" + header + "'"));
  call.local_peer = r.local_peer;
  call.peer = r.peer;
  call.peer_uri = r.peer_uri;
  const std::vector<std::string> parents = r.Values("traceparent");
  if (parents.size() == 1) {
    std::string state;
    for (const std::string& s : r.Values("tracestate")) state += (state.empty() ? "" : ",") + s;
    call.trace = ReadIncoming(parents.front(), state);
  }
  return call;
}

}  // namespace

OipHttp::OipHttp(OipProtocol& oip, std::string version, JsonLimits limits)
    : oip_(oip), version_(std::move(version)), limits_(limits) {}

void OipHttp::Handle(HttpRequest&& request, HttpReply reply) {
  const std::vector<std::string> path = Segments(request.path);
  const bool get = request.method == "GET" || request.method == "HEAD";
  const bool post = request.method == "POST";
  if (path.empty() || path[0] != "v2" || request.path.find("//") != std::string::npos)
    return reply(Failure(Status(StatusCode::kNotFound, "'" + request.path +
                                                           "': not a route; the protocol's "
                                                           "routes start with /v2")));
  if (path.size() == 3 && path[1] == "health" && get && (path[2] == "live" || path[2] == "ready")) {
    const bool ok = path[2] == "live" || oip_.pipeline().Ready("", 0);
    return reply(
        Json(ok ? 200 : 503, std::string("{\"") + path[2] + "\":" + (ok ? "true" : "false") + "}"));
  }
  StatusOr<CallContext> call = CallOf(request, oip_.pipeline());
  if (!call.ok()) return reply(Failure(call.status()));
  if (path.size() == 1 && get)
    return reply(Json(200, JsonOfServerMetadata("attnserve", version_, oip_.Extensions())));
  if (path.size() == 3 && path[1] == "repository" && path[2] == "index" && (post || get))
    return reply(Json(200, RepositoryIndex()));
  if (path.size() >= 2 && path[1] == "systemsharedmemory")
    return SharedMemory(std::move(request), path, *call, std::move(reply));
  if (path.size() >= 3 && path[1] == "models") {
    const bool versioned = path.size() >= 5 && path[3] == "versions";
    const size_t rest = versioned ? 5 : 3;
    const std::string version = versioned ? path[4] : "";
    if (path.size() == rest + 1 && path[rest] == "infer" && post)
      return Infer(std::move(request), *call, path[2], version, std::move(reply));
    if ((path.size() == rest || (path.size() == rest + 1 && path[rest] == "ready")) && get)
      return Model(path, std::move(reply));
  }
  return reply(Failure(
      Status(StatusCode::kNotFound, request.method + " " + request.path +
                                        ": not a route of the protocol (docs/api.md \"HTTP\")")));
}

void OipHttp::Model(const std::vector<std::string>& path, HttpReply reply) {
  const bool versioned = path.size() >= 5 && path[3] == "versions";
  const std::string& name = path[2];
  const std::string version = versioned ? path[4] : "";
  if (path.back() == "ready" && path.size() == (versioned ? 6u : 4u)) {
    const StatusOr<bool> ready = oip_.ModelReady(name, version);
    if (!ready.ok()) return reply(Failure(ready.status()));
    nlohmann::json j = {{"name", name}, {"ready", *ready}};
    return reply(
        Json(*ready ? 200 : 503, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
  }
  const StatusOr<inference::ModelMetadataResponse> m = oip_.ModelMetadata(name, version);
  if (!m.ok()) return reply(Failure(m.status()));
  reply(Json(200, JsonOfModelMetadata(*m)));
}

std::string OipHttp::RepositoryIndex() const {
  v1::ListModelsResponse models;
  oip_.pipeline().ListModels(&models);
  nlohmann::json out = nlohmann::json::array();
  for (const v1::ModelInfo& m : models.models()) {
    out.push_back({{"name", m.name()},
                   {"version", std::to_string(m.version())},
                   {"state", oip_.pipeline().Ready(m.name(), m.version()) ? "READY" : "LOADING"}});
  }
  return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void OipHttp::Infer(HttpRequest&& request, const CallContext& call, const std::string& model,
                    const std::string& version, HttpReply reply) {
  RequestPipeline& pipeline = oip_.pipeline();
  auto x = std::make_unique<OipExchange>();
  auto form = std::make_shared<HttpAnswerForm>();
  const Status st = Caught(kInferMethod, [&] {
    std::optional<size_t> header_length;
    if (const std::string* h = request.Header("inference-header-content-length")) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(h->c_str(), &end, 10);
      if (h->empty() || *end != '\0' || n > request.body.size()) {
        return InvalidArgument("Inference-Header-Content-Length: '" + h->substr(0, 24) +
                               "'; allowed: the JSON's byte count, at most the body's " +
                               std::to_string(request.body.size()));
      }
      header_length = static_cast<size_t>(n);
    }
    inference::ModelInferRequest infer;
    RETURN_IF_ERROR(
        HttpInferToOip(&request.body, header_length, model, version, limits_, &infer, form.get()));
    request.body = std::string();  // Its bytes are in `infer` now.
    RETURN_IF_ERROR(oip_.Decode(kInferMethod, &infer, call, x.get()));
    return oip_.BeginSequence(x.get());
  });
  if (!st.ok()) {
    pipeline.RecordUndecoded(kInferMethod, st);
    return reply(Failure(st));
  }
  pipeline.Attend(
      kInferMethod, std::move(x), call, [this, form, reply = std::move(reply)](Answered answered) {
        auto* x = static_cast<OipExchange*>(answered.get());
        oip_.EndSequence(*x, answered.status());
        const Status seen = answered.status().ok() ? OipWriteSharedOutputs(&x->answer, x->reply)
                                                   : answered.status();
        HttpResponse r;
        if (seen.ok()) {
          std::optional<size_t> header_length;
          OipAnswerToHttp(OipResponseHead(x->answer, x->reply), OipRawOutputs(&x->answer, x->reply),
                          *form, &r.head, &r.tail, &header_length);
          if (header_length) {
            r.content_type = "application/octet-stream";
            r.headers.emplace_back("Inference-Header-Content-Length",
                                   std::to_string(*header_length));
          }
        } else {
          r = Failure(seen, x->trace);
        }
        // Its bytes stay in the in-flight budget until the answer is sent.
        r.keep = std::make_shared<HeldBytes>(answered.Hand(seen));
        reply(std::move(r));
      });
}

void OipHttp::SharedMemory(HttpRequest&& request, const std::vector<std::string>& path,
                           const CallContext& call, HttpReply reply) {
  const bool get = request.method == "GET";
  const bool post = request.method == "POST";
  // /v2/systemsharedmemory[/region/NAME]/(status|register|unregister)
  const bool named = path.size() == 5 && path[2] == "region";
  if (!(path.size() == 3 || named))
    return reply(Failure(Status(StatusCode::kNotFound, request.path + ": not a route")));
  const std::string name = named ? path[3] : "";
  const std::string& verb = path.back();
  const TenantRegions regions = RegionsOf(oip_.shm(), call, oip_.pipeline());
  if (verb == "status" && (get || post)) {
    const StatusOr<std::vector<RegionInfo>> list = regions.List(name, false);
    if (!list.ok()) return reply(Failure(list.status()));
    nlohmann::json out = nlohmann::json::array();
    for (const RegionInfo& r : *list) {
      out.push_back(
          {{"name", r.name}, {"key", r.key}, {"offset", r.offset}, {"byte_size", r.byte_size}});
    }
    return reply(Json(200, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
  }
  if (verb == "register" && post && named) {
    const StatusOr<RegionRegistration> r = HttpRegistrationOf(&request.body, limits_);
    if (!r.ok()) return reply(Failure(r.status()));
    const Status st = regions.RegisterSystem(name, r->key, r->offset, r->byte_size);
    return reply(st.ok() ? Json(200, "{}") : Failure(st));
  }
  if (verb == "unregister" && post) {
    const Status st = regions.Unregister(name, /*cuda=*/false);
    return reply(st.ok() ? Json(200, "{}") : Failure(st));
  }
  reply(Failure(Status(StatusCode::kNotFound, request.method + " " + request.path +
                                                  ": not a route of the shared-memory extension")));
}

}  // namespace attnserve
