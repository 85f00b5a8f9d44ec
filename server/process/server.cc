#include "server/process/server.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>

#include <cstdlib>
#include <future>
#include <mutex>

#include "server/core/files.h"
#include "server/engine/blas.h"
#include "server/grpc/attention_service.h"
#include "server/grpc/call_counter.h"
#include "server/grpc/grpc_codec.h"
#include "server/grpc/health.h"
#include "server/oip/oip_service.h"
#include "server/pipeline/metrics.h"
#include "server/pipeline/request_pipeline.h"
#include "server/process/host_memory.h"
#include "server/process/memory_plan.h"
#include "server/process/memory_sampler.h"
#include "server/process/metrics_listener.h"
#include "server/process/reload_hooks.h"
#include "server/process/socket_linger.h"
#include "server/process/thread_stacks.h"

namespace attnserve {

/// The drain's hand-off: health says NOT_SERVING and unary calls are still served, until nothing is
/// in flight, no stream is open and no request has arrived for kDrainQuietPeriod (clients that
/// watch health have moved away), or for at most kDrainHandOff (a proxy such as nginx does not
/// watch health and keeps sending until the transport tells it to stop). Then gRPC stops: it closes
/// the listener and sends GOAWAY, which is what moves a proxy to the other replicas.
static constexpr std::chrono::milliseconds kDrainQuietPeriod{250};
static constexpr std::chrono::milliseconds kDrainHandOff{1000};
/// How often the stop looks again for connections left with no call on them.
static constexpr std::chrono::milliseconds kIdleCloseInterval{20};
/// How long no call must have begun before the stop closes the connections left: calls gRPC took
/// in just before it stopped reach their handlers within it.
static constexpr std::chrono::milliseconds kCallsSettle{100};

namespace {

// A PEM file named by a --tls-* flag, read like every other file the server reads (ReadFile: a
// regular file only, bounded, so a FIFO or a huge file cannot stall or swell the start-up).
StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  StatusOr<std::string> text = ReadFile(path, 1 << 20);
  if (!text.ok())
    return Status(StatusCode::kFailedPrecondition, flag + " " + text.status().message());
  if (text->find("-----BEGIN ") == std::string::npos) {
    return Status(StatusCode::kFailedPrecondition,
                  flag + " " + path + ": not PEM (no -----BEGIN line)");
  }
  return text;
}

// Plaintext, TLS, or mutual TLS (client certificates required and verified) from the --tls-* flags.
StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const ServerOptions& o) {
  const auto fail = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  if (o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    if (!o.tls_client_ca_file.empty())
      return fail("--tls-client-ca: needs --tls-cert and --tls-key (TLS)");
    return grpc::InsecureServerCredentials();
  }
  if (o.tls_cert_file.empty() || o.tls_key_file.empty()) {
    return fail(std::string("--tls-cert and --tls-key go together: got only ") +
                (o.tls_cert_file.empty() ? "--tls-key" : "--tls-cert"));
  }
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadPem("--tls-cert", o.tls_cert_file));
  ASSIGN_OR_RETURN(pair.private_key, ReadPem("--tls-key", o.tls_key_file));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!o.tls_client_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem("--tls-client-ca", o.tls_client_ca_file));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

namespace {
std::shared_ptr<ShutdownOutcome> MakeOutcome(std::shared_ptr<const CallCounter> calls) {
  auto outcome = std::make_shared<ShutdownOutcome>();
  outcome->calls = std::move(calls);
  return outcome;
}
}  // namespace

struct Server::Impl {
  ServerOptions options;
  std::unique_ptr<ModelRepository> models;
  std::unique_ptr<AdminServiceImpl> admin;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<MetricsListener> exposer;
  std::unique_ptr<MemorySampler> memory;
  std::unique_ptr<Batcher> batcher;
  std::unique_ptr<KvStore> kv;
  std::unique_ptr<RequestPipeline> pipeline;
  std::unique_ptr<AttentionServiceImpl> service;
  std::unique_ptr<OipServiceImpl> oip;
  // Shared with the shutdown outcome; declared before the servers, so it outlives their calls.
  std::shared_ptr<CallCounter> calls = std::make_shared<CallCounter>();
  std::shared_ptr<ShutdownOutcome> outcome = MakeOutcome(calls);
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<grpc::Server> health_server;  // --health-address: grpc.health.v1 only, plaintext
  std::unique_ptr<HealthReporter> health;
  SocketLinger linger;  // The client connections, held while the server stops.
  int port = 0;
  int health_port = 0;
  int metrics_port = 0;
  std::once_flag shutdown_once;
  MemoryPlan memory_plan;

  Status PlanMemory();
  Status StartMetrics();
  void StartPipeline();
  Status StartGrpc();
  Status StartHealth();
  void StopGrpc(SteadyClock::time_point cut_at, SteadyClock::time_point backstop);
  // Holds the client connections not held yet, for the lingering close (when it is on).
  void HoldConnections();
};

namespace {

Status Refuse(const std::string& message) {
  return Status(StatusCode::kFailedPrecondition, message);
}

// Options that no component checks by itself, and the BLAS the compute threads would share.
Status CheckOptions(const ServerOptions& options) {
  RETURN_IF_ERROR(options.batcher.Validate());
  RETURN_IF_ERROR(options.kv.Validate());
  RETURN_IF_ERROR(options.admin.Check(!options.tls_client_ca_file.empty()));
  const BlasInfo blas = ConfigureBlas();
  if (!blas.thread_safe && options.device == "cpu" && options.batcher.workers > 1) {
    // Several compute threads on such a BLAS silently give wrong answers, some of them another
    // request's: refuse rather than serve them.
    return Refuse(
        "--workers " + std::to_string(options.batcher.workers) + ": the BLAS is " +
        blas.description + "; with more than one compute thread it gives wrong results. " +
        "Install libopenblas0-pthread (docs/hardware.md \"BLAS\") or run with --workers 1");
  }
  return Status::Ok();
}

EngineOptions EngineOptionsOf(const ServerOptions& options) {
  EngineOptions engine;
  engine.device = options.device;
  engine.compute_dtype = options.compute_dtype;
  engine.allow_tf32 = options.allow_tf32;
  engine.varlen = options.varlen;
  return engine;
}

// A gRPC listener that refuses to share its port: gRPC sets SO_REUSEPORT by default, so a second
// attnserve on a port in use would start and take some of the first one's connections.
grpc::ServerBuilder& Builder(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  return builder;
}

}  // namespace

Status Server::Impl::PlanMemory() {
  // Sized once the models are loaded: their weights are part of the idle size.
  const MemoryLimit limit = ContainerMemoryLimit();
  MemoryPlanInput in;
  in.limit_bytes = limit.bytes;
  in.limit_source = limit.source;
  in.idle_bytes = ResidentBytes();
  in.workers = options.batcher.workers;
  in.budgets = {options.kv.budget_bytes, options.kv.max_entry_bytes,
                options.flow.max_inflight_bytes, options.max_message_bytes, options.memory_given};
  memory_plan = attnserve::PlanMemory(in);
  options.kv.budget_bytes = memory_plan.budgets.kv_budget_bytes;
  options.kv.max_entry_bytes = memory_plan.budgets.kv_max_entry_bytes;
  options.flow.max_inflight_bytes = memory_plan.budgets.max_inflight_bytes;
  options.max_message_bytes = static_cast<int>(memory_plan.budgets.max_message_bytes);
  return options.kv.Validate();
}

Status Server::Impl::StartMetrics() {
  metrics = std::make_unique<ServerMetrics>(*registry);
  metrics->SetCpuInfo(EngineCpuClass(), EngineOnednnDescription(), ConfigureBlas().description);
  for (const auto& [name, versions] : models->Snapshot()->models) {
    for (const auto& [version, model] : versions) metrics->AddModelInfo(model->spec());
  }
  memory = std::make_unique<MemorySampler>(options.device, *metrics);
  if (options.metrics_address.empty()) return Status::Ok();
  if (!ThreadStacksIncludeStaticTls()) {
    return Refuse(
        "--metrics-address: this executable does not export attnserve's pthread_attr_setstacksize "
        "(server/process/thread_stacks.cc); link it through attnserve::server");
  }
  ASSIGN_OR_RETURN(exposer, MetricsListener::Start(options.metrics_address, registry));
  metrics_port = exposer->port();
  return Status::Ok();
}

void Server::Impl::StartPipeline() {
  BatcherOptions batching = options.batcher;
  batching.on_batch = [m = metrics.get(), s = memory.get()](const std::string& model,
                                                            const std::vector<WorkItem*>& batch,
                                                            double seconds) {
    m->RecordBatch(model, batch, seconds);
    s->Sample();
  };
  batching.on_reject = [m = metrics.get()](const std::string& model, const char* reason) {
    m->RecordRejection(model, reason);
  };
  batcher = std::make_unique<Batcher>(std::move(batching));
  KvMetricsHooks kv_hooks;
  kv_hooks.on_size = [m = metrics.get()](int64_t bytes, int64_t memories, int64_t sessions) {
    m->SetKvSize(bytes, memories, sessions);
  };
  kv_hooks.on_lookup = [m = metrics.get()](KvKind kind, bool hit) {
    m->RecordKvLookup(KvKindName(kind), hit);
  };
  kv_hooks.on_end = [m = metrics.get()](KvKind kind, KvEndReason why) {
    m->RecordKvEnd(KvKindName(kind), KvEndReasonName(why));
  };
  kv_hooks.on_model_entries = [m = metrics.get()](const ModelSpec& spec, int64_t entries) {
    m->SetKvModelEntries(spec, entries);
  };
  kv = std::make_unique<KvStore>(options.kv, std::move(kv_hooks));
  AttendLimits limits = options.limits;
  limits.max_answer_bytes = int64_t{options.max_message_bytes} - int64_t{kResponseOverheadBytes};
  pipeline =
      std::make_unique<RequestPipeline>(*models, *batcher, *metrics, limits, options.flow, *kv);
  service = std::make_unique<AttentionServiceImpl>(*pipeline, *calls);
  oip = std::make_unique<OipServiceImpl>(
      *pipeline, *calls, static_cast<size_t>(options.kv.max_entries),
      std::chrono::duration_cast<SteadyClock::duration>(
          std::chrono::duration<double>(options.kv.ttl_seconds)));
  admin = std::make_unique<AdminServiceImpl>(*models, *calls, options.admin);
}

namespace {

// ServerOptions::advertise_address, or --address with `port` when its host is a concrete one.
std::string AdvertisedAddress(const ServerOptions& options, int port) {
  if (!options.advertise_address.empty()) return options.advertise_address;
  const std::string host = options.address.substr(0, options.address.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "*") return "";
  return host + ":" + std::to_string(port);
}

}  // namespace

Status Server::Impl::StartGrpc() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   ServerCredentials(options));
  Builder(builder).AddListeningPort(options.address, credentials, &port);
  builder.RegisterService(service.get());
  builder.RegisterService(oip.get());
  builder.RegisterService(admin.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> counters;
  counters.push_back(calls->HealthChecks());
  builder.experimental().SetInterceptorCreators(std::move(counters));
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  // Known before the first call when --address names its port; port 0 is known once bound.
  const std::string port_text = options.address.substr(options.address.rfind(':') + 1);
  if (port_text != "0")
    pipeline->SetAdvertisedAddress(AdvertisedAddress(options, std::atoi(port_text.c_str())));
  grpc_server = builder.BuildAndStart();
  if (grpc_server && port_text == "0")
    pipeline->SetAdvertisedAddress(AdvertisedAddress(options, port));
  if (grpc_server && port != 0) return Status::Ok();
  return Refuse(
      "--address " + options.address + ": cannot listen (in use, or not an address" +
      (options.tls_cert_file.empty() ? ")" : "; or --tls-cert and --tls-key do not match)"));
}

Status Server::Impl::StartHealth() {
  if (!options.health_address.empty()) {
    grpc::ServerBuilder builder;  // No services of its own: only the default health service.
    Builder(builder).AddListeningPort(options.health_address, grpc::InsecureServerCredentials(),
                                      &health_port);
    health_server = builder.BuildAndStart();
    if (!health_server || health_port == 0) {
      grpc_server->Shutdown();
      return Refuse("--health-address " + options.health_address +
                    ": cannot listen (in use, or not an address)");
    }
  }
  std::vector<grpc::HealthCheckServiceInterface*> services;
  for (grpc::Server* s : {grpc_server.get(), health_server.get()}) {
    if (s != nullptr) services.push_back(s->GetHealthCheckService());
  }
  health = std::make_unique<HealthReporter>(std::move(services), *models->Snapshot());
  // Reloads tell metrics, health and the store what changed (on the reloading thread, which
  // Shutdown stops before the servers go).
  models->SetHooks(ReloadHooks(*metrics, *kv, *health));
  return Status::Ok();
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() { Shutdown(); }

StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  ASSIGN_OR_RETURN(impl->models,
                   ModelRepository::Open(options.models_dir, EngineOptionsOf(options)));
  RETURN_IF_ERROR(impl->PlanMemory());
  RETURN_IF_ERROR(impl->StartMetrics());
  impl->StartPipeline();
  RETURN_IF_ERROR(impl->StartGrpc());
  RETURN_IF_ERROR(impl->StartHealth());
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

int Server::port() const { return impl_->port; }
int Server::metrics_port() const { return impl_->metrics_port; }
int Server::health_port() const { return impl_->health_port; }

std::string Server::Describe() const {
  std::string s = "attnserve: serving";
  for (const auto& [name, versions] : impl_->models->Snapshot()->models) {
    for (const auto& [version, model] : versions) {
      const ModelSpec& m = model->spec();
      s += " " + name + (versions.size() > 1 || version != 1 ? "/" + std::to_string(version) : "") +
           " (E=" + std::to_string(m.embed_dim) + ", H=" + std::to_string(m.num_heads) + ", " +
           m.weights_hash.substr(0, 19) + ", " + DTypeName(m.compute_dtype) + ": " + m.kernels +
           ")";
    }
  }
  const std::string host = impl_->options.address.substr(0, impl_->options.address.rfind(':'));
  s += " on " + host + ":" + std::to_string(impl_->port);
  s += impl_->exposer ? ", metrics on http://" +
                            impl_->options.metrics_address.substr(
                                0, impl_->options.metrics_address.rfind(':')) +
                            ":" + std::to_string(impl_->metrics_port) + "/metrics"
                      : ", metrics off";
  if (!impl_->options.tls_cert_file.empty()) {
    s += impl_->options.tls_client_ca_file.empty() ? ", TLS"
                                                   : ", mutual TLS (client certificates required)";
  }
  if (impl_->health_server) {
    const std::string& h = impl_->options.health_address;
    s += ", plaintext health on " + h.substr(0, h.rfind(':')) + ":" +
         std::to_string(impl_->health_port);
  }
  const BatcherOptions& b = impl_->options.batcher;
  s += ", device " + impl_->options.device + ", " + std::to_string(b.workers) +
       " workers, batching " +
       (b.enabled ? std::to_string(b.max_batch_tokens) + " tokens/" +
                        std::to_string(b.max_queue_delay.count()) + " us"
                  : std::string("off")) +
       ", " + EngineDescription() + ", CPU " + EngineCpuClass() + " (" + EngineOnednnDescription() +
       "), BLAS " + ConfigureBlas().description;
  const std::string advertised = impl_->pipeline->advertised_address();
  s += ", replica " + impl_->kv->replica_id() +
       (advertised.empty() ? " (advertises no address)" : " advertised as " + advertised);
  if (!impl_->memory_plan.description.empty()) s += ", " + impl_->memory_plan.description;
  return s;
}

std::string Server::MemoryWarning() const { return impl_->memory_plan.warning; }

void Server::Impl::HoldConnections() {
  if (options.lingering_close) outcome->connections_held = linger.HoldConnectionsOn(port);
}

void Server::Impl::StopGrpc(SteadyClock::time_point cut_at, SteadyClock::time_point backstop) {
  const auto system_backstop =
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::max(backstop - SteadyClock::now(), SteadyClock::duration::zero()));
  // Held before gRPC may close any, so that no answer still travelling is reset (SocketLinger).
  HoldConnections();
  std::future<void> stopped = std::async(
      std::launch::async, [this, system_backstop] { grpc_server->Shutdown(system_backstop); });
  // gRPC's Shutdown also waits for every connection to close, which each client does only once it
  // has read the GOAWAY: a grpcio client with no call open reads it at its next backup poll, up to
  // 5 s later, and a client's health watch stays open until cut. So once no call attnserve took is
  // open, what is left is closed at once (and again, until gRPC is done, in case a connection
  // slipped in before the listener closed: it is held too). The first look waits a moment so
  // gRPC's own shutdown has begun. At `cut_at` the calls still open are cancelled, and each that
  // then ends cancelled is counted as cut. (gRPC's own deadline, `backstop`, comes later.)
  while (stopped.wait_for(kIdleCloseInterval) != std::future_status::ready) {
    HoldConnections();
    const bool none = calls->WaitNone(cut_at, kCallsSettle);
    if (!none) calls->BeginCut();
    grpc_server_cancel_all_calls(grpc_server->c_server());
    if (!none) break;
  }
  stopped.wait();
}

std::shared_ptr<const ShutdownOutcome> Server::shutdown_outcome() const { return impl_->outcome; }

void Server::RequestReload() { impl_->models->RequestReload(nullptr); }

void Server::Shutdown() {
  std::call_once(impl_->shutdown_once, [this] {
    const auto start = SteadyClock::now();
    const auto grace = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(impl_->options.shutdown_grace_seconds));
    // 1. Hand off while gRPC still serves: load balancers see NOT_SERVING, unary calls are served
    //    as before, open streams take no new requests and finish once answered (their clients
    //    reopen elsewhere). Calls that reach a gRPC server already shutting down are cancelled by
    //    gRPC itself (CANCELLED, see docs/shutdown.md "Shutdown"), so the hand-off first gives
    //    clients that watch health the time to leave.
    impl_->HoldConnections();  // Answers sent from now on are read whole.
    impl_->health->Shutdown();
    impl_->pipeline->BeginDrain();
    impl_->models->Stop();  // Reloads waiting are answered UNAVAILABLE; none starts.
    impl_->pipeline->WaitIdle(
        start + std::min<SteadyClock::duration>(kDrainHandOff, grace * 8 / 10), kDrainQuietPeriod);
    // 2. Stop gRPC: listener closed, GOAWAY; calls accepted finish; whatever is still open at 90%
    //    of the grace period is cancelled. Then the queue drains (work still computing finishes).
    impl_->StopGrpc(start + grace * 9 / 10, start + grace * 19 / 20);
    impl_->batcher->Drain();
    impl_->grpc_server->Wait();
    if (impl_->health_server) {
      // Health only: its checks are answered at once, its watches are cut.
      impl_->health_server->Shutdown(std::chrono::system_clock::now());
      impl_->health_server->Wait();
    }
    // 3. gRPC has closed its connections; ours close once their clients have everything.
    impl_->outcome->connections_unread = impl_->linger.CloseWhenRead(start + grace * 19 / 20);
    impl_->exposer.reset();
    impl_->models.reset();
  });
}

}  // namespace attnserve
