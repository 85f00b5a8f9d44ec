#include "attnserve/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "attnserve/half.h"
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

// The bytes a channel first reads at once (GRPC_ARG_TCP_READ_CHUNK_SIZE), as the server's
// --transport-read-chunk-bytes.
constexpr int kReadChunkBytes = 2 << 20;

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
  out->set_priority(r.priority);
  out->set_queue_timeout_us(r.queue_timeout_us);
  if (r.query_position) out->set_query_position(*r.query_position);
  out->set_key_position(r.key_position);
  for (int64_t p : r.positions) out->add_positions(p);
  if (r.output_shared_memory) ToWire(*r.output_shared_memory, out->mutable_output_shared_memory());
  if (r.attn_weights_shared_memory)
    ToWire(*r.attn_weights_shared_memory, out->mutable_attn_weights_shared_memory());
  if (r.steps.empty()) return;
  // A batched step: the entries carry the queries, handles and positions; the request none.
  out->clear_model();
  out->clear_query();
  out->clear_is_causal();
  out->clear_layout();
  for (const Step& s : r.steps) {
    pb::Step* step = out->add_steps();
    step->set_session(s.session);
    step->set_memory(s.memory);
    ToWire(s.query, step->mutable_query());
    if (s.session_length) step->set_session_length(*s.session_length);
    if (s.query_position) step->set_query_position(*s.query_position);
    for (int64_t p : s.positions) step->add_positions(p);
    if (s.key_padding_mask) ToWire(*s.key_padding_mask, step->mutable_key_padding_mask());
  }
}

// float32 values in `to` (bfloat16 or float16), rounded to nearest even.
Tensor Narrowed(const Tensor& t, DataType to) {
  Tensor out{to, t.shape, std::string(t.data.size() / 2, '\0'), std::nullopt};
  const float* in = reinterpret_cast<const float*>(t.data.data());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data.data());
  const size_t n = t.data.size() / 4;
  for (size_t i = 0; i < n; ++i)
    o[i] = to == DataType::kBFloat16 ? FloatToBFloat16(in[i]) : FloatToHalf(in[i]);
  return out;
}

// A 16-bit answer widened back to float32 (exact).
void Widen(Tensor* t) {
  if (t->dtype != DataType::kBFloat16 && t->dtype != DataType::kFloat16) return;
  std::string wide(t->data.size() * 2, '\0');
  const uint16_t* in = reinterpret_cast<const uint16_t*>(t->data.data());
  float* o = reinterpret_cast<float*>(wide.data());
  for (size_t i = 0; i < t->data.size() / 2; ++i)
    o[i] = t->dtype == DataType::kBFloat16 ? BFloat16ToFloat(in[i]) : HalfToFloat(in[i]);
  t->data = std::move(wide);
  t->dtype = DataType::kFloat32;
}

void Widen(AttendResult* r) {
  Widen(&r->output);
  if (r->attn_weights) Widen(&*r->attn_weights);
  for (StepResult& s : r->steps) Widen(&s.output);
}

bool Narrowable(const Tensor& t) { return t.dtype == DataType::kFloat32 && !t.shared_memory; }

// `request` with its float32 query, key and value in `to`.
AttendRequest NarrowRequest(const AttendRequest& request, DataType to) {
  AttendRequest r = request;
  r.query = Narrowed(request.query, to);
  if (r.key) r.key = Narrowed(*request.key, to);
  if (r.value) r.value = Narrowed(*request.value, to);
  for (Step& s : r.steps) s.query = Narrowed(s.query, to);
  return r;
}

// The memory or session a request is routed by: its own, or a batched step's first entry's.
const std::string& HandleOf(const AttendRequest& r) {
  if (!r.steps.empty()) {
    const Step& first = r.steps.front();
    return first.session.empty() ? first.memory : first.session;
  }
  return r.session.empty() ? r.memory : r.session;
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
  for (pb::StepResult& s : *r->mutable_steps()) {
    StepResult step;
    step.status.code = s.error().code();
    step.status.message = s.error().message();
    if (s.has_output()) step.output = FromWire(s.mutable_output());
    step.session_length = s.session_length();
    out.steps.push_back(std::move(step));
  }
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
  out.family = m.family();
  out.layer = m.layer();
  out.num_kv_heads = m.num_kv_heads();
  out.head_dim = m.head_dim();
  out.rotary_theta = m.rotary_theta();
  out.rotary_dim = m.rotary_dim();
  out.rope_type = m.rope_type();
  out.sliding_window = m.sliding_window();
  out.qk_norm = m.qk_norm();
  out.scale = m.scale();
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
  // ClientOptions::connections channels, each its own connection; calls go round robin.
  std::vector<std::shared_ptr<grpc::Channel>> pool;
  std::vector<std::unique_ptr<pb::AttentionService::Stub>> pool_stubs;
  std::atomic<size_t> next{0};
  pb::AttentionService::Stub* Next() {
    return pool_stubs[next.fetch_add(1, std::memory_order_relaxed) % pool_stubs.size()].get();
  }

  // The compute dtype of each model this client asked for (ClientOptions::wire_dtype).
  std::mutex dtypes_mu;
  std::map<std::pair<std::string, int64_t>, DataType> dtypes;
  // The 16-bit dtype `request`'s float32 query, key and value travel in, when its model computes
  // in one (the model's, or the one of the memory or session it names, when this client made it).
  std::optional<DataType> WireOf(const AttendRequest& request) {
    if (options.wire_dtype != ClientOptions::WireDtype::kModel) return std::nullopt;
    if (request.steps.empty()
            ? !Narrowable(request.query) || (request.key && !Narrowable(*request.key)) ||
                  (request.value && !Narrowable(*request.value))
            : !std::all_of(request.steps.begin(), request.steps.end(),
                           [](const Step& s) { return Narrowable(s.query); }))
      return std::nullopt;
    std::string model = request.model;
    int64_t version = request.model_version;
    const std::string& handle = HandleOf(request);
    if (!handle.empty()) {
      const KvRoute route = routes.Find(handle);
      if (route.model.empty()) return std::nullopt;
      model = route.model;
      version = route.model_version;
    }
    return WireOf(model, version);
  }
  std::optional<DataType> WireOf(const std::string& model, int64_t version) {
    {
      std::lock_guard<std::mutex> lock(dtypes_mu);
      auto it = dtypes.find({model, version});
      if (it != dtypes.end()) return Sixteen(it->second);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::GetModelRequest req;
    req.set_name(model);
    req.set_version(version);
    pb::ModelInfo info;
    if (!stub->GetModel(&ctx, req, &info).ok()) return std::nullopt;  // The call will say why.
    const auto dtype = static_cast<DataType>(info.compute_dtype());
    std::lock_guard<std::mutex> lock(dtypes_mu);
    dtypes[{model, version}] = dtype;
    return Sixteen(dtype);
  }
  static std::optional<DataType> Sixteen(DataType d) {
    return d == DataType::kBFloat16 || d == DataType::kFloat16 ? std::optional<DataType>(d)
                                                               : std::nullopt;
  }
  static AttendRequest Narrow(const AttendRequest& request, DataType to) {
    return NarrowRequest(request, to);
  }
  std::unique_ptr<pb::AdminService::Stub> admin;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;

  void Prepare(grpc::ClientContext* ctx, const CallOptions& call) const {
    const auto deadline = call.deadline.value_or(options.deadline);
    if (deadline.count() > 0) ctx->set_deadline(std::chrono::system_clock::now() + deadline);
    if (!call.bearer_token.empty())
      ctx->AddMetadata("authorization", "Bearer " + call.bearer_token);
    if (!call.traceparent.empty()) ctx->AddMetadata("traceparent", call.traceparent);
    if (!call.tracestate.empty()) ctx->AddMetadata("tracestate", call.tracestate);
    for (const auto& [key, value] : call.metadata) ctx->AddMetadata(key, value);
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
    if (handle.empty()) return Next();
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
    // A megabyte answer arrives in a few reads instead of hundreds of 8 KiB (gRPC adapts the size
    // from there): attnserve-echo's 2 MB round trip 1.8 -> ~1.5 ms with the server's alike.
    args.SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, kReadChunkBytes);
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
  // The pool: the main channel, then more with a subchannel pool of their own (gRPC shares one
  // connection among channels of equal arguments otherwise).
  impl_->pool.push_back(impl_->channel);
  for (int i = 1; i < std::max(1, options.connections); ++i) {
    grpc::ChannelArguments args = channel_args(options.service_config);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("attnserve.connection", i);
    impl_->pool.push_back(grpc::CreateCustomChannel(options.target, credentials, args));
  }
  for (const auto& ch : impl_->pool) impl_->pool_stubs.push_back(pb::AttentionService::NewStub(ch));
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
  if (const std::optional<DataType> wire = impl_->WireOf(request)) {
    // The model computes in 16 bits: the tensors travel in them, the answer is widened here.
    ToWire(Impl::Narrow(request, *wire), &rpc->request);
    rpc->done = [done = std::move(done)](CallStatus s, AttendResult r) {
      Widen(&r);
      done(std::move(s), std::move(r));
    };
  } else {
    ToWire(request, &rpc->request);
    rpc->done = std::move(done);
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ++impl_->in_flight;
  }
  pb::AttentionService::Stub* stub = impl_->Routed(HandleOf(request), &rpc->ctx, &rpc->replica);
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
  // `wire_of`: the 16-bit dtype a request travels in (ClientOptions::wire_dtype), or none.
  StreamReactor(pb::AttentionService::Stub* stub,
                std::function<void(CallStatus, AttendResult)> on_response,
                std::chrono::milliseconds deadline,
                std::function<std::optional<DataType>(const AttendRequest&)> wire_of)
      : on_response_(std::move(on_response)), wire_of_(std::move(wire_of)) {
    if (deadline.count() > 0) ctx_.set_deadline(std::chrono::system_clock::now() + deadline);
    stub->async()->AttendStream(&ctx_, this);
    StartRead(&response_);
    StartCall();
  }
  ~StreamReactor() override { Finish(); }

  bool Send(const AttendRequest& request) override {
    const std::optional<DataType> wire = wire_of_ ? wire_of_(request) : std::nullopt;
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || closing_) return false;
    if (wire) {
      ToWire(NarrowRequest(request, *wire), &pending_.emplace_back());
      widen_.insert(request.request_id);  // Its answer is widened back to float32.
    } else {
      ToWire(request, &pending_.emplace_back());
    }
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
    bool widen = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      widen = widen_.erase(result.request_id) > 0;
    }
    if (widen) Widen(&result);
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
  std::function<std::optional<DataType>(const AttendRequest&)> wire_of_;
  std::multiset<uint64_t> widen_;  // Request ids sent narrowed, answers not yet read.
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
  std::shared_ptr<Impl> impl = impl_;
  return std::make_unique<StreamReactor>(
      impl_->Next(), std::move(on_response), call.deadline.value_or(impl_->options.deadline),
      [impl](const AttendRequest& r) { return impl->WireOf(r); });
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
  std::optional<DataType> wire;
  if (impl_->options.wire_dtype == ClientOptions::WireDtype::kModel && Narrowable(request.key) &&
      Narrowable(request.value))
    wire = impl_->WireOf(request.model, request.model_version);
  ToWire(wire ? Narrowed(request.key, *wire) : request.key, req.mutable_key());
  ToWire(wire ? Narrowed(request.value, *wire) : request.value, req.mutable_value());
  if (request.key_padding_mask) ToWire(*request.key_padding_mask, req.mutable_key_padding_mask());
  req.set_layout(static_cast<pb::Layout>(request.layout));
  req.set_key_position(request.key_position);
  pb::KvHandle resp;
  const grpc::Status s = impl_->stub->CreateMemory(&ctx, req, &resp);
  if (s.ok()) {
    *memory = FromWire(resp);
    impl_->routes.Remember(resp.handle(),
                           KvRoute{resp.replica(), resp.model(), resp.model_version()});
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
    impl_->routes.Remember(resp.handle(),
                           KvRoute{resp.replica(), resp.model(), resp.model_version()});
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
    impl_->routes.Remember(resp.handle(), KvRoute{resp.replica(), resp.model(),
                                                  resp.model_version()});  // The parent's replica.
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
