#include "attnserve/client.h"

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <deque>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "attnserve/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kv_routes.h"

// A call handed to gRPC comes back on another thread (the completion-queue poller, or a callback
// thread). Debian's gRPC is not built with ThreadSanitizer, so TSan cannot see that handoff; these
// tell it, and compile to nothing in other builds.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define ATTNSERVE_HANDOFF_RELEASE(p) __tsan_release(p)
#define ATTNSERVE_HANDOFF_ACQUIRE(p) __tsan_acquire(p)
#else
#define ATTNSERVE_HANDOFF_RELEASE(p) (void)(p)
#define ATTNSERVE_HANDOFF_ACQUIRE(p) (void)(p)
#endif

namespace attnserve {
namespace pb = ::attnserve::v1;
namespace {

void ToWire(const SharedMemoryRef& r, pb::SharedMemoryRef* out) {
  out->set_region(r.region);
  out->set_offset(r.offset);
  out->set_byte_size(r.byte_size);
}

void ToWire(const Tensor& t, pb::Tensor* out) {
  out->set_dtype(static_cast<pb::DataType>(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  if (t.shared_memory) {
    ToWire(*t.shared_memory, out->mutable_shared_memory());
  } else {
    out->set_data(t.data);
  }
}

Tensor FromWire(pb::Tensor* t) {
  Tensor out;
  out.dtype = static_cast<DataType>(t->dtype());
  out.shape.assign(t->shape().begin(), t->shape().end());
  out.data = std::move(*t->mutable_data());  // A move, not a copy: the response is heap-allocated.
  return out;
}

void ToWire(const AttendRequest& r, pb::AttendRequest* out) {
  // A memory or session names its model; `model` (default "demo") is not sent with one.
  if (r.memory.empty() && r.session.empty()) out->set_model(r.model);
  ToWire(r.query, out->mutable_query());
  if (r.key) ToWire(*r.key, out->mutable_key());
  if (r.value) ToWire(*r.value, out->mutable_value());
  if (r.key_padding_mask) ToWire(*r.key_padding_mask, out->mutable_key_padding_mask());
  if (r.attn_mask) ToWire(*r.attn_mask, out->mutable_attn_mask());
  out->set_is_causal(r.is_causal);
  out->set_attn_weights(static_cast<pb::AttnWeights>(r.attn_weights));
  out->set_layout(static_cast<pb::Layout>(r.layout));
  out->set_request_id(r.request_id);
  out->set_model_version(r.model_version);
  out->set_memory(r.memory);
  out->set_session(r.session);
  out->set_traceparent(r.traceparent);
  out->set_tracestate(r.tracestate);
  if (r.session_length) out->set_session_length(*r.session_length);
  if (r.output_shared_memory) ToWire(*r.output_shared_memory, out->mutable_output_shared_memory());
  if (r.attn_weights_shared_memory)
    ToWire(*r.attn_weights_shared_memory, out->mutable_attn_weights_shared_memory());
}

KvInfo FromWire(const pb::KvHandle& h) {
  return KvInfo{h.handle(), h.model(), h.model_version(), h.weights_hash(), h.batch(),
                h.length(), h.bytes(), h.ttl_seconds(),   h.replica()};
}

AttendResult FromWire(pb::AttendResponse* r) {
  AttendResult out;
  out.output = FromWire(r->mutable_output());
  if (r->has_attn_weights()) out.attn_weights = FromWire(r->mutable_attn_weights());
  out.request_id = r->request_id();
  out.model = r->model();
  out.weights_hash = r->weights_hash();
  out.model_version = r->model_version();
  out.queue_seconds = r->timing().queue_seconds();
  out.compute_seconds = r->timing().compute_seconds();
  out.batch_size = r->timing().batch_size();
  out.previous_attempts = r->timing().previous_attempts();
  out.session_length = r->session_length();
  return out;
}

ModelInfo FromWire(const pb::ModelInfo& m) {
  ModelInfo out;
  out.name = m.name();
  out.embed_dim = m.embed_dim();
  out.num_heads = m.num_heads();
  out.kdim = m.kdim();
  out.vdim = m.vdim();
  out.bias = m.bias();
  out.add_bias_kv = m.add_bias_kv();
  out.add_zero_attn = m.add_zero_attn();
  out.compute_dtype = static_cast<DataType>(m.compute_dtype());
  out.device = m.device();
  out.weights_hash = m.weights_hash();
  out.source = m.source();
  out.version = m.version();
  return out;
}

// A call's outcome; a failed one names the server's trace of it (docs/tracing.md) when `ctx`
// carries it back.
CallStatus FromGrpc(const grpc::Status& s, const grpc::ClientContext* ctx = nullptr) {
  CallStatus out{static_cast<int>(s.error_code()), s.error_message(), ""};
  if (!s.ok() && ctx) {
    const auto& trailing = ctx->GetServerTrailingMetadata();
    if (auto it = trailing.find("attnserve-trace-id"); it != trailing.end())
      out.trace_id.assign(it->second.data(), it->second.size());
  }
  return out;
}

}  // namespace

const char* StatusCodeName(int code) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN";
}

std::string CallStatus::ToString() const {
  return ok() ? "OK" : std::string(StatusCodeName(code)) + ": " + message;
}

// One unary call on the completion-queue API; the poller thread completes and deletes it.
struct AsyncAttend {
  grpc::ClientContext ctx;
  std::string replica;  // The replica a routed call went straight to ("" when none).
  pb::AttendRequest request;
  pb::AttendResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<pb::AttendResponse>> reader;
  std::function<void(CallStatus, AttendResult)> done;
};

struct Client::Impl {
  ClientOptions options;
  // Async unary calls whose callback has not returned yet: ~Client waits for them.
  std::mutex mu;
  std::condition_variable idle;
  int in_flight = 0;
  // Unary async calls use the completion-queue API with this poller, not gRPC's callback API:
  // under load gRPC 1.51's callback completion queue double-frees itself (bench/RESULTS.md).
  grpc::CompletionQueue cq;
  std::thread poller;

  void Poll() {
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
      ATTNSERVE_HANDOFF_ACQUIRE(tag);
      std::unique_ptr<AsyncAttend> call(static_cast<AsyncAttend*>(tag));
      call->done(Explained(FromGrpc(call->status, &call->ctx), call->replica),
                 call->status.ok() ? FromWire(&call->response) : AttendResult{});
      call.reset();
      std::lock_guard<std::mutex> lock(mu);
      if (--in_flight == 0) idle.notify_all();
    }
  }
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::AttentionService::Stub> stub;
  std::unique_ptr<pb::AdminService::Stub> admin;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;

  void Prepare(grpc::ClientContext* ctx, const CallOptions& call) const {
    const auto deadline = call.deadline.value_or(options.deadline);
    if (deadline.count() > 0) ctx->set_deadline(std::chrono::system_clock::now() + deadline);
    if (!call.bearer_token.empty())
      ctx->AddMetadata("authorization", "Bearer " + call.bearer_token);
    if (!call.traceparent.empty()) ctx->AddMetadata("traceparent", call.traceparent);
    if (!call.tracestate.empty()) ctx->AddMetadata("tracestate", call.tracestate);
  }

  // Memories and sessions this client made: their routes, and a channel to each replica that
  // holds some (ClientOptions::route_to_replica).
  KvRoutes routes;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  grpc::ChannelArguments replica_args;  // The channel's, without balancing or health checks.
  std::mutex replicas_mu;
  std::map<std::string, std::unique_ptr<pb::AttentionService::Stub>> replicas;

  // The stub for calls on `handle` (empty: none), with its replica named in `ctx`'s metadata;
  // `replica` gets that replica's address ("" when the call is not routed).
  pb::AttentionService::Stub* Routed(const std::string& handle, grpc::ClientContext* ctx,
                                     std::string* replica) {
    replica->clear();
    if (handle.empty()) return stub.get();
    const std::string address = routes.Find(handle).replica;
    if (address.empty()) return stub.get();
    ctx->AddMetadata(KvRoutes::kMetadataKey, address);
    *replica = address;
    if (!options.route_to_replica || address == options.target) return stub.get();
    std::lock_guard<std::mutex> lock(replicas_mu);
    auto& s = replicas[address];
    if (!s) {
      s = pb::AttentionService::NewStub(
          grpc::CreateCustomChannel(address, credentials, replica_args));
    }
    return s.get();
  }
  // One unary call on the memory or session `handle`: deadline and token set, sent to the replica
  // that holds it, and a failure for want of that replica explained.
  template <typename Request, typename Response>
  CallStatus Kept(const std::string& handle, const CallOptions& call,
                  grpc::Status (pb::AttentionService::Stub::*rpc)(grpc::ClientContext*,
                                                                  const Request&, Response*),
                  const Request& req, Response* resp) {
    grpc::ClientContext ctx;
    Prepare(&ctx, call);
    std::string replica;
    pb::AttentionService::Stub* to = Routed(handle, &ctx, &replica);
    const grpc::Status s = (to->*rpc)(&ctx, req, resp);
    return Explained(FromGrpc(s, &ctx), replica);
  }
  // Names the replica when a call routed to it failed for want of it.
  static CallStatus Explained(CallStatus s, const std::string& replica) {
    if (!replica.empty() && (s.code == 14 || s.code == 4)) {
      s.message += " (the call went to the replica at " + replica +
                   ", which holds this memory or session: if it stopped, what it held is gone; "
                   "make it again)";
    }
    return s;
  }
};

// The two service configs differ only in load balancing and health checking; each is a file in
// deploy/grpc/ too, and ServiceConfigTest checks that the four agree.
const char* const kDefaultServiceConfig = R"json({
  "loadBalancingConfig": [{"round_robin": {}}],
  "healthCheckConfig": {"serviceName": "attnserve.v1.AttentionService"},
  "methodConfig": [{
    "name": [{"service": "attnserve.v1.AttentionService"}, {"service": "inference.GRPCInferenceService"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.05s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]
    }
  }]
}
)json";

const char* const kProxyServiceConfig = R"json({
  "methodConfig": [{
    "name": [{"service": "attnserve.v1.AttentionService"}, {"service": "inference.GRPCInferenceService"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.05s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]
    }
  }]
}
)json";

namespace {

std::string ReadPemFile(const std::string& path, const char* option) {
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) text.clear();
  if (text.empty()) {
    throw std::invalid_argument(std::string(option) + " " + path +
                                ": cannot read it (or it is empty)");
  }
  return text;
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(const TlsOptions& tls) {
  if (!tls.enabled) {
    if (!tls.root_certs_file.empty() || !tls.cert_file.empty() || !tls.key_file.empty()) {
      throw std::invalid_argument("TLS files given without enabling TLS (TlsOptions::enabled)");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    throw std::invalid_argument("TLS client certificate and key go together: got only the " +
                                std::string(tls.cert_file.empty() ? "key" : "certificate"));
  }
  grpc::SslCredentialsOptions ssl;
  if (!tls.root_certs_file.empty())
    ssl.pem_root_certs = ReadPemFile(tls.root_certs_file, "TLS root certificates");
  if (!tls.cert_file.empty()) {
    ssl.pem_cert_chain = ReadPemFile(tls.cert_file, "TLS client certificate");
    ssl.pem_private_key = ReadPemFile(tls.key_file, "TLS client key");
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

Client::Client(const ClientOptions& options) : impl_(std::make_shared<Impl>()) {
  impl_->options = options;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  try {
    credentials = Credentials(options.tls);
  } catch (...) {
    impl_->cq.Shutdown();  // Nothing was queued; a queue must be shut down before it is destroyed.
    throw;
  }
  auto channel_args = [&options](const std::string& service_config) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.max_message_bytes);
    args.SetMaxSendMessageSize(options.max_message_bytes);
    // A call can only be retried while its request is still buffered: keep whole requests.
    args.SetInt("grpc.per_rpc_retry_buffer_size", options.max_message_bytes);
    if (!service_config.empty()) args.SetServiceConfigJSON(service_config);
    if (!options.tls.server_name.empty()) args.SetSslTargetNameOverride(options.tls.server_name);
    for (const auto& [name, value] : options.channel_args) args.SetInt(name, value);
    return args;
  };
  impl_->channel =
      grpc::CreateCustomChannel(options.target, credentials, channel_args(options.service_config));
  // One replica, one address: the retries without the balancing.
  impl_->replica_args = channel_args(options.service_config.empty() ? "" : kProxyServiceConfig);
  impl_->credentials = credentials;
  impl_->stub = pb::AttentionService::NewStub(impl_->channel);
  impl_->admin = pb::AdminService::NewStub(impl_->channel);
  impl_->health = grpc::health::v1::Health::NewStub(impl_->channel);
  impl_->poller = std::thread([impl = impl_.get()] { impl->Poll(); });
}

Client::~Client() {
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->idle.wait(lock, [this] { return impl_->in_flight == 0; });
  }
  impl_->cq.Shutdown();
  impl_->poller.join();
}

CallStatus Client::Attend(const AttendRequest& request, AttendResult* result,
                          const CallOptions& call) {
  std::promise<CallStatus> promise;
  AttendAsync(
      request,
      [&](CallStatus status, AttendResult r) {
        if (status.ok()) *result = std::move(r);
        promise.set_value(std::move(status));
      },
      call);
  return promise.get_future().get();
}

void Client::AttendAsync(const AttendRequest& request,
                         std::function<void(CallStatus, AttendResult)> done,
                         const CallOptions& call) {
  auto* rpc = new AsyncAttend;
  impl_->Prepare(&rpc->ctx, call);
  ToWire(request, &rpc->request);
  rpc->done = std::move(done);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ++impl_->in_flight;
  }
  pb::AttentionService::Stub* stub = impl_->Routed(
      request.session.empty() ? request.memory : request.session, &rpc->ctx, &rpc->replica);
  rpc->reader = stub->PrepareAsyncAttend(&rpc->ctx, rpc->request, &impl_->cq);
  rpc->reader->StartCall();
  auto* reader = rpc->reader.get();
  ATTNSERVE_HANDOFF_RELEASE(rpc);  // Nothing here touches rpc after this: the poller deletes it.
  reader->Finish(&rpc->response, &rpc->status, rpc);
}

namespace {

// Writes one at a time from a queue; reads until the server ends the stream.
class StreamReactor final : public grpc::ClientBidiReactor<pb::AttendRequest, pb::AttendResponse>,
                            public AttendStream {
 public:
  StreamReactor(pb::AttentionService::Stub* stub,
                std::function<void(CallStatus, AttendResult)> on_response,
                std::chrono::milliseconds deadline)
      : on_response_(std::move(on_response)) {
    if (deadline.count() > 0) ctx_.set_deadline(std::chrono::system_clock::now() + deadline);
    stub->async()->AttendStream(&ctx_, this);
    StartRead(&response_);
    StartCall();
  }
  ~StreamReactor() override { Finish(); }

  bool Send(const AttendRequest& request) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || closing_) return false;
    ToWire(request, &pending_.emplace_back());
    if (!writing_) {
      writing_ = true;
      StartWrite(&pending_.front());
    }
    return true;
  }

  CallStatus Finish() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!closing_) {
      closing_ = true;
      if (!writing_) StartWritesDone();
    }
    cv_.wait(lock, [this] { return done_; });
    return status_;
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.pop_front();
    if (ok && !pending_.empty()) {
      StartWrite(&pending_.front());
      return;
    }
    writing_ = false;
    if (closing_ && ok) StartWritesDone();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    CallStatus status;
    if (response_.has_error())
      status = CallStatus{response_.error().code(), response_.error().message(),
                          response_.error().trace_id()};
    AttendResult result = status.ok() ? FromWire(&response_) : AttendResult{};
    result.request_id = response_.request_id();
    on_response_(std::move(status), std::move(result));
    response_.Clear();
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = FromGrpc(s);
    done_ = true;
    cv_.notify_all();
  }

 private:
  grpc::ClientContext ctx_;
  std::function<void(CallStatus, AttendResult)> on_response_;
  pb::AttendResponse response_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<pb::AttendRequest> pending_;  // Front is being written.
  bool writing_ = false;
  bool closing_ = false;
  bool done_ = false;
  CallStatus status_;
};

}  // namespace

std::unique_ptr<AttendStream> Client::OpenStream(
    std::function<void(CallStatus, AttendResult)> on_response, const CallOptions& call) {
  return std::make_unique<StreamReactor>(impl_->stub.get(), std::move(on_response),
                                         call.deadline.value_or(impl_->options.deadline));
}

CallStatus Client::ListModels(std::vector<ModelInfo>* models, const CallOptions& call) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::ListModelsResponse resp;
  const grpc::Status s = impl_->stub->ListModels(&ctx, pb::ListModelsRequest(), &resp);
  models->clear();
  for (const auto& m : resp.models()) models->push_back(FromWire(m));
  return FromGrpc(s);
}

CallStatus Client::GetModel(const std::string& name, ModelInfo* model, const CallOptions& call) {
  return GetModel(name, 0, model, call);
}

bool ReloadResult::any_failed() const {
  for (const ModelChange& c : changes) {
    if (c.action == "failed") return true;
  }
  return false;
}

CallStatus Client::ReloadModels(ReloadResult* result, const CallOptions& call) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::ReloadModelsResponse resp;
  const grpc::Status s = impl_->admin->ReloadModels(&ctx, pb::ReloadModelsRequest(), &resp);
  *result = ReloadResult();
  for (const pb::ModelChange& c : resp.changes()) {
    static const char* kActions[] = {"unspecified", "loaded", "updated", "unloaded", "failed"};
    const int a = static_cast<int>(c.action());
    result->changes.push_back({c.name(), c.version(),
                               a >= 0 && a <= 4 ? kActions[a] : "unspecified", c.weights_hash(),
                               c.message()});
  }
  result->models_served = resp.models_served();
  return FromGrpc(s);
}

CallStatus Client::GetModel(const std::string& name, int64_t version, ModelInfo* model,
                            const CallOptions& call) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::GetModelRequest req;
  req.set_name(name);
  req.set_version(version);
  pb::ModelInfo resp;
  const grpc::Status s = impl_->stub->GetModel(&ctx, req, &resp);
  if (s.ok()) *model = FromWire(resp);
  return FromGrpc(s);
}

CallStatus Client::CreateMemory(const MemoryRequest& request, KvInfo* memory,
                                const CallOptions& call) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::CreateMemoryRequest req;
  req.set_model(request.model);
  req.set_model_version(request.model_version);
  ToWire(request.key, req.mutable_key());
  ToWire(request.value, req.mutable_value());
  if (request.key_padding_mask) ToWire(*request.key_padding_mask, req.mutable_key_padding_mask());
  req.set_layout(static_cast<pb::Layout>(request.layout));
  pb::KvHandle resp;
  const grpc::Status s = impl_->stub->CreateMemory(&ctx, req, &resp);
  if (s.ok()) {
    *memory = FromWire(resp);
    impl_->routes.Remember(resp.handle(), KvRoute{resp.replica()});
  }
  return FromGrpc(s, &ctx);
}

CallStatus Client::OpenSession(const std::string& model, int64_t batch, KvInfo* session,
                               const CallOptions& call, int64_t model_version) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::OpenSessionRequest req;
  req.set_model(model);
  req.set_model_version(model_version);
  req.set_batch(batch);
  pb::KvHandle resp;
  const grpc::Status s = impl_->stub->OpenSession(&ctx, req, &resp);
  if (s.ok()) {
    *session = FromWire(resp);
    impl_->routes.Remember(resp.handle(), KvRoute{resp.replica()});
  }
  return FromGrpc(s, &ctx);
}

CallStatus Client::ForkSession(const std::string& handle, KvInfo* fork, const CallOptions& call) {
  pb::ForkSessionRequest req;
  req.set_handle(handle);
  pb::KvHandle resp;
  const CallStatus s =
      impl_->Kept(handle, call, &pb::AttentionService::Stub::ForkSession, req, &resp);
  if (s.ok()) {
    *fork = FromWire(resp);
    impl_->routes.Remember(resp.handle(), KvRoute{resp.replica()});  // The parent's replica.
  }
  return s;
}

CallStatus Client::TruncateSession(const std::string& handle, int64_t length, KvInfo* session,
                                   const CallOptions& call) {
  pb::TruncateSessionRequest req;
  req.set_handle(handle);
  req.set_length(length);
  pb::KvHandle resp;
  const CallStatus s =
      impl_->Kept(handle, call, &pb::AttentionService::Stub::TruncateSession, req, &resp);
  if (s.ok() && session != nullptr) *session = FromWire(resp);
  return s;
}

CallStatus Client::DeleteMemory(const std::string& handle, const CallOptions& call) {
  pb::ReleaseRequest req;
  req.set_handle(handle);
  pb::ReleaseResponse resp;
  const CallStatus s =
      impl_->Kept(handle, call, &pb::AttentionService::Stub::DeleteMemory, req, &resp);
  if (s.ok() || s.code == static_cast<int>(grpc::StatusCode::NOT_FOUND))
    impl_->routes.Forget(handle);
  return s;
}

CallStatus Client::CloseSession(const std::string& handle, const CallOptions& call) {
  pb::ReleaseRequest req;
  req.set_handle(handle);
  pb::ReleaseResponse resp;
  const CallStatus s =
      impl_->Kept(handle, call, &pb::AttentionService::Stub::CloseSession, req, &resp);
  if (s.ok() || s.code == static_cast<int>(grpc::StatusCode::NOT_FOUND))
    impl_->routes.Forget(handle);
  return s;
}

CallStatus Client::RegisterSharedMemory(const std::string& name, const std::string& key,
                                        uint64_t offset, uint64_t byte_size,
                                        const CallOptions& call) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::RegisterSharedMemoryRequest req;
  req.set_name(name);
  req.set_key(key);
  req.set_offset(offset);
  req.set_byte_size(byte_size);
  pb::RegisterSharedMemoryResponse resp;
  return FromGrpc(impl_->stub->RegisterSharedMemory(&ctx, req, &resp));
}

CallStatus Client::UnregisterSharedMemory(const std::string& name, const CallOptions& call) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::UnregisterSharedMemoryRequest req;
  req.set_name(name);
  pb::UnregisterSharedMemoryResponse resp;
  return FromGrpc(impl_->stub->UnregisterSharedMemory(&ctx, req, &resp));
}

CallStatus Client::SharedMemoryStatus(const std::string& name,
                                      std::vector<SharedMemoryRegionInfo>* regions,
                                      const CallOptions& call) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  pb::SharedMemoryStatusRequest req;
  req.set_name(name);
  pb::SharedMemoryStatusResponse resp;
  const grpc::Status s = impl_->stub->SharedMemoryStatus(&ctx, req, &resp);
  regions->clear();
  for (const auto& r : resp.regions())
    regions->push_back({r.name(), r.key(), r.offset(), r.byte_size()});
  return FromGrpc(s);
}

CallStatus Client::Health(const std::string& service, bool* serving, const CallOptions& call) {
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  const grpc::Status s = impl_->health->Check(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  *serving = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  return CallStatus{};
}

}  // namespace attnserve
