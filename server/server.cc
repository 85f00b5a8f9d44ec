#include "server/server.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>

#include "server/attention_service.h"
#include "server/engine/blas.h"
#include "server/engine/device_support.h"
#include "server/engine/model_loader.h"
#include "server/engine/safetensors.h"
#include "server/metrics.h"
#include "server/thread_stacks.h"
#include "server/wire.h"

namespace attnserve {

/// The drain's hand-off: health says NOT_SERVING and unary calls are still served, until nothing is in
/// flight, no stream is open and no request has arrived for kDrainQuietPeriod (clients that watch
/// health have moved away), or for at most kDrainHandOff (a proxy such as nginx does not watch
/// health and keeps sending until the transport tells it to stop). Then gRPC stops: it closes the
/// listener and sends GOAWAY, which is what moves a proxy to the other replicas.
static constexpr std::chrono::milliseconds kDrainQuietPeriod{250};
static constexpr std::chrono::milliseconds kDrainHandOff{1000};

/// Health service names: "" (overall), the service, and "<service>/<model>" per model.
static constexpr char kServiceName[] = "attnserve.v1.AttentionService";
/// Health of the model repository: NOT_SERVING while the latest load of some model failed (what
/// served before still serves).
static constexpr char kRepositoryHealthName[] = "attnserve.v1.ModelRepository";

namespace {

// A PEM file named by a --tls-* flag, read like every other file the server reads (ReadFile: a
// regular file only, bounded, so a FIFO or a huge file cannot stall or swell the start-up).
StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  StatusOr<std::string> text = ReadFile(path, 1 << 20);
  if (!text.ok()) return Status(StatusCode::kFailedPrecondition, flag + " " + text.status().message());
  if (text->find("-----BEGIN ") == std::string::npos) {
    return Status(StatusCode::kFailedPrecondition, flag + " " + path + ": not PEM (no -----BEGIN line)");
  }
  return text;
}

// Plaintext, TLS, or mutual TLS (client certificates required and verified) from the --tls-* flags.
StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const ServerOptions& o) {
  const auto fail = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  if (o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    if (!o.tls_client_ca_file.empty()) return fail("--tls-client-ca: needs --tls-cert and --tls-key (TLS)");
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

struct Server::Impl {
  ServerOptions options;
  std::unique_ptr<ModelRepository> models;
  std::unique_ptr<AdminServiceImpl> admin;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<prometheus::Exposer> exposer;
  std::unique_ptr<Batcher> batcher;
  std::unique_ptr<KvStore> kv;
  std::unique_ptr<AttentionServiceImpl> service;
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<grpc::Server> health_server;  // --health-address: grpc.health.v1 only, plaintext
  int port = 0;
  int health_port = 0;
  int metrics_port = 0;
  std::once_flag shutdown_once;
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() { Shutdown(); }

StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  const auto fail = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  RETURN_IF_ERROR(options.batcher.Validate());
  const BlasInfo blas = ConfigureBlas();
  if (!blas.thread_safe && options.device == "cpu" && options.batcher.workers > 1) {
    // Several compute threads on such a BLAS silently give wrong answers, some of them another
    // request's: refuse rather than serve them.
    return fail("--workers " + std::to_string(options.batcher.workers) + ": the BLAS is " +
                blas.description + "; with more than one compute thread it gives wrong results. " +
                "Install libopenblas0-pthread (README \"BLAS\") or run with --workers 1");
  }

  RETURN_IF_ERROR(options.admin.Check(!options.tls_client_ca_file.empty()));
  EngineOptions engine_options;
  engine_options.device = options.device;
  engine_options.compute_dtype = options.compute_dtype;
  engine_options.allow_tf32 = options.allow_tf32;
  engine_options.varlen = options.varlen;
  ASSIGN_OR_RETURN(impl->models, ModelRepository::Open(options.models_dir, engine_options));

  impl->metrics = std::make_unique<ServerMetrics>(*impl->registry);
  for (const auto& [name, versions] : impl->models->Snapshot()->models) {
    for (const auto& [version, model] : versions) impl->metrics->AddModelInfo(model->spec());
  }
  if (!options.metrics_address.empty()) {
    if (!ThreadStacksIncludeStaticTls()) {
      return fail("--metrics-address: this executable does not export attnserve's "
                  "pthread_attr_setstacksize (server/thread_stacks.cc); link it through "
                  "attnserve::server");
    }
    try {
      impl->exposer = std::make_unique<prometheus::Exposer>(options.metrics_address);
    } catch (const std::exception& e) {
      return fail("--metrics-address " + options.metrics_address + ": cannot listen: " + e.what());
    }
    impl->exposer->RegisterCollectable(impl->registry);
    const auto ports = impl->exposer->GetListeningPorts();
    impl->metrics_port = ports.empty() ? 0 : ports.front();
  }

  BatcherOptions batcher_options = options.batcher;
  ServerMetrics* metrics = impl->metrics.get();
  // On CUDA, each batch also refreshes the device's allocator gauges.
  int cuda_index = -1;
  if (options.device.rfind("cuda", 0) == 0) {
    cuda_index = options.device.size() > 5 ? std::atoi(options.device.c_str() + 5) : 0;
  }
  batcher_options.on_batch = [metrics, cuda_index](const std::string& model,
                                                   const std::vector<WorkItem*>& batch,
                                                   double seconds) {
    metrics->RecordBatch(model, batch, seconds);
    DeviceMemory memory;
    if (cuda_index >= 0 && ReadDeviceMemory(cuda_index, &memory)) {
      metrics->SetDeviceMemory("cuda:" + std::to_string(cuda_index), memory.allocated, memory.reserved);
    } else if (cuda_index < 0) {
      // On the CPU the device's memory is the process's: its resident set, read at most once a
      // second (a /proc read per batch would cost more than the gauge is worth).
      static std::atomic<int64_t> last_read_ns{0};
      const int64_t now = SteadyClock::now().time_since_epoch().count();
      int64_t last = last_read_ns.load(std::memory_order_relaxed);
      if (now - last >= 1'000'000'000 && last_read_ns.compare_exchange_strong(last, now)) {
        long pages_total = 0, pages_resident = 0;
        if (FILE* f = std::fopen("/proc/self/statm", "r")) {
          if (std::fscanf(f, "%ld %ld", &pages_total, &pages_resident) == 2) {
            metrics->SetHostMemory(static_cast<int64_t>(pages_resident) * sysconf(_SC_PAGESIZE));
          }
          std::fclose(f);
        }
      }
    }
  };
  batcher_options.on_reject = [metrics](const std::string& model, const char* reason) {
    metrics->RecordRejection(model, reason);
  };
  impl->batcher = std::make_unique<Batcher>(std::move(batcher_options));
  AttendLimits limits = options.limits;
  limits.max_answer_bytes =
      static_cast<int64_t>(options.max_message_bytes) - static_cast<int64_t>(kResponseOverheadBytes);
  RETURN_IF_ERROR(options.kv.Validate());
  KvMetricsHooks kv_hooks;
  kv_hooks.on_size = [metrics](int64_t bytes, int64_t memories, int64_t sessions) {
    metrics->SetKvSize(bytes, memories, sessions);
  };
  kv_hooks.on_lookup = [metrics](KvKind kind, bool hit) { metrics->RecordKvLookup(KvKindName(kind), hit); };
  kv_hooks.on_end = [metrics](KvKind kind, KvEndReason why) {
    metrics->RecordKvEnd(KvKindName(kind), KvEndReasonName(why));
  };
  impl->kv = std::make_unique<KvStore>(options.kv, std::move(kv_hooks));
  impl->service = std::make_unique<AttentionServiceImpl>(*impl->models, *impl->batcher, *impl->metrics,
                                                         limits, options.flow, *impl->kv);
  impl->admin = std::make_unique<AdminServiceImpl>(*impl->models, options.admin);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second attnserve on a port in use would start and share
  // the port with the first, each taking some of the connections. Refuse instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::shared_ptr<grpc::ServerCredentials> credentials;
  ASSIGN_OR_RETURN(credentials, ServerCredentials(options));
  builder.AddListeningPort(options.address, credentials, &impl->port);
  builder.RegisterService(impl->service.get());
  builder.RegisterService(impl->admin.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  impl->grpc_server = builder.BuildAndStart();
  if (!impl->grpc_server || impl->port == 0) {
    return fail("--address " + options.address + ": cannot listen (in use, or not an address" +
                (options.tls_cert_file.empty() ? ")" : "; or --tls-cert and --tls-key do not match)"));
  }
  if (!options.health_address.empty()) {
    grpc::ServerBuilder health_builder;  // No services of its own: only the default health service.
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_builder.AddListeningPort(options.health_address, grpc::InsecureServerCredentials(),
                                    &impl->health_port);
    impl->health_server = health_builder.BuildAndStart();
    if (!impl->health_server || impl->health_port == 0) {
      impl->grpc_server->Shutdown();
      return fail("--health-address " + options.health_address + ": cannot listen (in use, or not an address)");
    }
  }
  std::vector<grpc::HealthCheckServiceInterface*> healths;
  for (grpc::Server* s : {impl->grpc_server.get(), impl->health_server.get()}) {
    if (s != nullptr) healths.push_back(s->GetHealthCheckService());
  }
  std::set<std::string> known;  // Every model name health has reported on.
  for (auto* health : healths) {
    health->SetServingStatus(true);
    health->SetServingStatus(kServiceName, true);
    health->SetServingStatus(kRepositoryHealthName, true);
    for (const auto& [name, versions] : impl->models->Snapshot()->models) {
      health->SetServingStatus(std::string(kServiceName) + "/" + name, true);
      known.insert(name);
    }
  }
  // Reloads tell metrics and health what changed (on the reloading thread, which Shutdown stops
  // before the servers go).
  ModelRepositoryHooks hooks;
  // Memories and sessions of a version that leaves (replaced or removed) end with it.
  KvStore* kv = impl->kv.get();
  hooks.on_loaded = [metrics, kv](const ModelSpec& loaded, const ModelSpec* replaced) {
    if (replaced) {
      metrics->RemoveModelInfo(*replaced);
      kv->EndModel(*replaced);
    }
    metrics->AddModelInfo(loaded);
  };
  hooks.on_unloaded = [metrics, kv](const ModelSpec& removed) {
    metrics->RemoveModelInfo(removed);
    kv->EndModel(removed);
  };
  hooks.on_reloaded = [metrics, healths, known](const ReloadReport& report, const ModelSet& set,
                                                const std::map<std::string, std::string>& failing) mutable {
    std::vector<std::string> failed_now;
    for (const RepositoryChange& c : report.changes) {
      if (c.action == RepositoryChange::Action::kFailed &&
          (failed_now.empty() || failed_now.back() != c.name)) {
        failed_now.push_back(c.name);
      }
    }
    metrics->RecordReload(report.failed(), failed_now);
    std::vector<std::string> failing_names;
    for (const auto& [name, why] : failing) failing_names.push_back(name);
    metrics->SetModelsFailing(failing_names);
    for (const auto& [name, why] : failing) known.insert(name);
    for (const auto& [name, versions] : set.models) known.insert(name);
    for (auto* health : healths) {
      health->SetServingStatus(kRepositoryHealthName, report.status.ok() && failing.empty());
      for (const std::string& name : known) {
        health->SetServingStatus(std::string(kServiceName) + "/" + name, set.models.count(name) > 0);
      }
    }
  };
  impl->models->SetHooks(std::move(hooks));
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
           m.weights_hash.substr(0, 19) + ")";
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
    s += impl_->options.tls_client_ca_file.empty() ? ", TLS" : ", mutual TLS (client certificates required)";
  }
  if (impl_->health_server) {
    const std::string& h = impl_->options.health_address;
    s += ", plaintext health on " + h.substr(0, h.rfind(':')) + ":" + std::to_string(impl_->health_port);
  }
  const BatcherOptions& b = impl_->options.batcher;
  s += ", device " + impl_->options.device + ", " + std::to_string(b.workers) + " workers, batching " +
       (b.enabled ? std::to_string(b.max_batch_tokens) + " tokens/" +
                        std::to_string(b.max_queue_delay.count()) + " us"
                  : std::string("off")) +
       ", " + EngineDescription() + ", BLAS " + ConfigureBlas().description;
  return s;
}

void Server::RequestReload() { impl_->models->RequestReload(nullptr); }

void Server::Shutdown() {
  std::call_once(impl_->shutdown_once, [this] {
    const auto start = SteadyClock::now();
    const auto grace = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(impl_->options.shutdown_grace_seconds));
    // 1. Hand off while gRPC still serves: load balancers see NOT_SERVING, unary calls are served
    //    as before, open streams take no new requests and finish once answered (their clients
    //    reopen elsewhere). Calls that reach a gRPC server already shutting down are cancelled by
    //    gRPC itself (CANCELLED, see README "Shutdown"), so the hand-off first gives clients that
    //    watch health the time to leave.
    impl_->grpc_server->GetHealthCheckService()->Shutdown();
    if (impl_->health_server) impl_->health_server->GetHealthCheckService()->Shutdown();
    impl_->service->BeginDrain();
    impl_->models->Stop();  // Reloads waiting are answered UNAVAILABLE; none starts.
    impl_->service->WaitIdle(start + std::min<SteadyClock::duration>(kDrainHandOff, grace * 8 / 10),
                             kDrainQuietPeriod);
    // 2. Stop gRPC (listener closed, GOAWAY); calls already accepted finish; whatever is still open
    //    at 90% of the grace period is cancelled.
    const auto left = start + grace * 9 / 10 - SteadyClock::now();
    impl_->grpc_server->Shutdown(std::chrono::system_clock::now() +
                                 std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                     std::max(left, SteadyClock::duration::zero())));
    impl_->batcher->Drain();
    impl_->grpc_server->Wait();
    if (impl_->health_server) {
      impl_->health_server->Shutdown();
      impl_->health_server->Wait();
    }
    impl_->exposer.reset();
    impl_->models.reset();
  });
}

}  // namespace attnserve
