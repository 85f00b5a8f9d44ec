#include "server/process/server.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>

#include "server/core/files.h"
#include "server/engine/blas.h"
#include "server/grpc/call_counter.h"
#include "server/grpc/grpc_codec.h"
#include "server/grpc/health.h"
#include "server/oip/oip_service.h"
#include "server/pipeline/metrics.h"
#include "server/pipeline/request_pipeline.h"
#include "server/process/cuda_regions.h"
#include "server/process/host_memory.h"
#include "server/process/listener_watch.h"
#include "server/process/memory_plan.h"
#include "server/process/memory_sampler.h"
#include "server/process/metrics_listener.h"
#include "server/process/reload_hooks.h"
#include "server/process/server_impl.h"
#include "server/process/thread_stacks.h"
#include "server/process/transport_metrics.h"
#include "server/process/unix_listener.h"
#include "server/v1/attention_service.h"

namespace attnserve {

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

bool IsCuda(const std::string& device) { return device.rfind("cuda", 0) == 0; }

SteadyClock::duration Seconds(double seconds) {
  return std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(seconds));
}

Status Refuse(const std::string& message) {
  return Status(StatusCode::kFailedPrecondition, message);
}

// Options that no component checks by itself, and the BLAS the compute threads would share.
// A metadata key gRPC passes as text: lowercase letters, digits, '-', '_', '.'; not gRPC's own
// ("grpc-"), not binary ("-bin"), nor one attnserve reads for something else.
Status CheckTenantHeader(const std::string& key) {
  if (key.empty()) return Status::Ok();
  const bool chars = std::all_of(key.begin(), key.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
  });
  const auto ends = [&](const std::string& tail) {
    return key.size() >= tail.size() &&
           key.compare(key.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (!chars || key.rfind("grpc-", 0) == 0 || ends("-bin") || key == "authorization" ||
      key == "traceparent" || key == "tracestate" || key.size() > 128) {
    return Refuse("--tenant-header '" + key +
                  "': expected a text metadata key (lowercase letters, digits, '-', '_', '.'; not "
                  "grpc-*, *-bin, authorization, traceparent or tracestate)");
  }
  return Status::Ok();
}

Status CheckOptions(const ServerOptions& options) {
  RETURN_IF_ERROR(options.batcher.Validate());
  RETURN_IF_ERROR(options.kv.Validate());
  RETURN_IF_ERROR(options.admin.Check(!options.tls_client_ca_file.empty()));
  RETURN_IF_ERROR(options.batcher.priorities.Validate(
      "--priority-levels, --default-priority-level, --queue-policy"));
  RETURN_IF_ERROR(CheckTenantHeader(options.tenant_header));
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

// Each registered region and each connection holds a descriptor: the soft limit on open files is
// raised to the hard one, 256 descriptors are kept for models, logs and the rest, and regions and
// connections get at most half of what is left each (a hostile review, 2026-11-28: under
// systemd's 1,024, registrations took every descriptor, accept() failed, and gRPC 1.51's listener
// never took a connection again; 2026-12-05: 20,100 idle connections did the same).
struct DescriptorShares {
  size_t regions;
  int64_t connections;
};
DescriptorShares ShareDescriptors(size_t max_regions, int64_t max_connections) {
  struct rlimit files {};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0) return {max_regions, max_connections};
  if (files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
    ::getrlimit(RLIMIT_NOFILE, &files);
  }
  constexpr rlim_t kKept = 256;
  const rlim_t room = files.rlim_cur > 2 * kKept ? files.rlim_cur - kKept : files.rlim_cur / 2;
  return {std::min<size_t>(max_regions, static_cast<size_t>(room / 2)),
          std::min<int64_t>(max_connections, static_cast<int64_t>(std::max<rlim_t>(room / 2, 1)))};
}

// What the batcher will give each model: the shapes its warm-up runs.
WarmupShapes WarmupOf(const ServerOptions& options) {
  if (!options.warmup) return WarmupShapes::Off();
  WarmupShapes w;
  w.batch_tokens = options.batcher.max_batch_tokens;
  w.shared_request_tokens = options.batcher.max_shared_request_tokens;
  w.max_request_tokens = options.limits.max_tokens;
  w.max_attention_scores = options.limits.max_attention_scores;
  return w;
}

EngineOptions EngineOptionsOf(const ServerOptions& options, std::shared_ptr<HostStaging> staging) {
  EngineOptions engine;
  engine.staging = std::move(staging);
  engine.device = options.device;
  engine.compute_dtype = options.compute_dtype;
  engine.allow_tf32 = options.allow_tf32;
  engine.varlen = options.varlen;
  // A pool (kept runs) holds at most the budget its rows count against, in chunks no larger.
  if (options.kv.budget_bytes > 0) {
    engine.kv_pool_chunk_bytes = std::min(options.kv.budget_bytes, int64_t{1} << 30);
    engine.kv_pool_max_bytes = options.kv.budget_bytes;
  }
  return engine;
}

// A gRPC listener with the transport's bounds (TransportOptions) that refuses to share its port:
// gRPC sets SO_REUSEPORT by default, so a second attnserve on a port in use would start and take
// some of the first one's connections. Compressed requests are refused (UNIMPLEMENTED naming the
// algorithm): gRPC 1.51 inflates a message whole before it checks its size, so a few MB of gzip
// became gigabytes. Streams per connection, the handshake, idle connections and metadata are
// bounded, and every connection's buffers count against one resource quota.
grpc::ServerBuilder& Builder(grpc::ServerBuilder& builder, const TransportOptions& t,
                             grpc::ResourceQuota& quota) {
  const auto ms = [](double seconds) {
    return static_cast<int>(std::min(seconds * 1e3, static_cast<double>(INT32_MAX)));
  };
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(t.limits.h2.max_concurrent_streams));
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, ms(t.handshake_timeout_seconds));
  if (t.max_connection_idle_seconds > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, ms(t.max_connection_idle_seconds));
  }
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, static_cast<int>(t.max_metadata_bytes));
  builder.AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE, static_cast<int>(t.read_chunk_bytes));
  builder.SetResourceQuota(quota);
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
  in.budgets = {
      options.kv.budget_bytes,   options.kv.max_entry_bytes, options.flow.max_inflight_bytes,
      options.max_message_bytes, options.memory_given,       staging ? staging->budget_bytes() : 0};
  memory_plan = attnserve::PlanMemory(in);
  if (staging) staging->SetBudget(memory_plan.budgets.staging_bytes);
  options.kv.budget_bytes = memory_plan.budgets.kv_budget_bytes;
  options.kv.max_entry_bytes = memory_plan.budgets.kv_max_entry_bytes;
  options.flow.max_inflight_bytes = memory_plan.budgets.max_inflight_bytes;
  options.max_message_bytes = static_cast<int>(memory_plan.budgets.max_message_bytes);
  // The transport's share: the messages arriving at once that the plan counts, of the size it set,
  // and the requests in flight, whose wire bytes gRPC holds until the handler is done with them.
  TransportOptions& t = options.transport;
  t.limits.h2.header_timeout = Seconds(t.header_timeout_seconds);
  const int64_t arriving = kArrivingMessages * int64_t{options.max_message_bytes};
  if (t.memory_bytes <= 0) t.memory_bytes = options.flow.max_inflight_bytes + arriving;
  if (t.limits.max_partial_bytes <= 0) t.limits.max_partial_bytes = arriving;
  if (t.limits.max_partial_bytes_per_peer <= 0) t.limits.max_partial_bytes_per_peer = arriving;
  // A message over --max-message-bytes is read and refused by gRPC (RESOURCE_EXHAUSTED, a status
  // its caller can act on), within the peer's upload bound; one announced past that bound could
  // never arrive whole, and closes its connection at its prefix.
  t.limits.h2.max_message_bytes =
      std::max<int64_t>(options.max_message_bytes, t.limits.max_partial_bytes_per_peer);
  return options.kv.Validate();
}

Status Server::Impl::StartMetrics() {
  metrics = std::make_unique<ServerMetrics>(*registry);
  metrics->SetCpuInfo(EngineCpuClass(), EngineOnednnDescription(), ConfigureBlas().description);
  for (const auto& [name, versions] : models->Snapshot()->models) {
    for (const auto& [version, model] : versions) metrics->AddModelInfo(model->spec());
  }
  memory = std::make_unique<MemorySampler>(options.device, *metrics, staging.get());
  if (options.metrics_address.empty()) return Status::Ok();
  if (!ThreadStacksIncludeStaticTls()) {
    return Refuse(
        "--metrics-address: this executable does not export attnserve's pthread_attr_setstacksize "
        "(server/process/thread_stacks.cc); link it through attnserve::server");
  }
  ASSIGN_OR_RETURN(exposer, MetricsListener::Start(options.metrics_address, registry));
  exposer->Register(std::make_shared<TransportMetrics>(&calls->sends()));
  metrics_port = exposer->port();
  return Status::Ok();
}

namespace {

// --trace-endpoint as gRPC's target: a URL's scheme goes (https:// turns TLS on), a host alone
// takes OTLP/gRPC's port 4317.
ExporterOptions ExporterOptionsOf(const TracingOptions& t) {
  ExporterOptions e;
  std::string target = t.endpoint;
  e.tls = t.tls;
  for (const char* scheme : {"http://", "https://"}) {
    if (target.rfind(scheme, 0) == 0) {
      e.tls = e.tls || std::string(scheme) == "https://";
      target = target.substr(std::string(scheme).size());
    }
  }
  if (!target.empty() && target.back() == '/') target.pop_back();
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos || target.back() == ']') target += ":4317";
  e.endpoint = target;
  e.tls_ca_file = t.tls_ca_file;
  e.tls_cert_file = t.tls_cert_file;
  e.tls_key_file = t.tls_key_file;
  return e;
}

}  // namespace

void Server::Impl::StartKv() {
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
  kv_hooks.on_tenant_bytes = [m = metrics.get()](const std::string& label, int64_t bytes) {
    m->SetTenantKvBytes(label, bytes);
  };
  kv = std::make_unique<KvStore>(options.kv, std::move(kv_hooks));
}

Status Server::Impl::StartTracing() {
  const TracingOptions& t = options.tracing;
  if (!t.endpoint.empty()) {
    ExporterOptions e = ExporterOptionsOf(t);
    e.resource = {{"service.name", t.service_name},
                  {"service.version", std::string(ATTNSERVE_VERSION)},
                  {"service.instance.id", kv->replica_id()},
                  {"telemetry.sdk.name", std::string("attnserve")}};
    e.on_exported = [m = metrics.get()](int64_t n) { m->RecordSpansExported(n); };
    e.on_dropped = [m = metrics.get()](int64_t n, const char* why) {
      m->RecordSpansDropped(n, why);
    };
    ASSIGN_OR_RETURN(exporter, OtlpExporter::Start(std::move(e)));
  }
  tracer = std::make_unique<Tracer>(t.rate, exporter.get());
  if (!t.access_log.empty()) {
    ASSIGN_OR_RETURN(access_log,
                     AccessLog::Open(t.access_log, t.access_log_max_lines,
                                     [m = metrics.get()] { m->RecordAccessLogDropped(); }));
  }
  return Status::Ok();
}

void Server::Impl::StartPipeline() {
  BatcherOptions batching = options.batcher;
  batching.tracer = tracer->on() ? tracer.get() : nullptr;
  batching.on_batch = [m = metrics.get(), s = memory.get()](const std::string& model,
                                                            const std::vector<WorkItem*>& batch,
                                                            double seconds) {
    m->RecordBatch(model, batch, seconds);
    s->Sample();
  };
  batching.on_reject = [m = metrics.get()](const WorkItem& item, const char* reason) {
    m->RecordRejection(item.model->spec().name, reason);
    m->RecordTenantRejection(item.tenant_label, reason);
  };
  batcher = std::make_unique<Batcher>(std::move(batching));
  AttendLimits limits = options.limits;
  limits.max_answer_bytes = int64_t{options.max_message_bytes} - int64_t{kResponseOverheadBytes};
  FlowLimits flow = options.flow;
  flow.max_region_input_bytes = options.max_message_bytes;
  pipeline = std::make_unique<RequestPipeline>(*models, *batcher, *metrics, limits, flow, *kv);
  pipeline->Observe(tracer.get(), access_log.get());
  pipeline->SetTenantHeader(options.tenant_header);
  pipeline->SetCallerByPeer(options.fair_by_peer);
  pipeline->SetWarming(options.warmup);
  pipeline->SetStaging(staging.get());
  pipeline->Publish();
  SharedMemoryOptions shared = options.shared_memory;
  const DescriptorShares shares =
      ShareDescriptors(shared.max_regions, options.transport.limits.max_connections);
  shared.max_regions = shares.regions;
  options.transport.limits.max_connections = shares.connections;
  shared.on_change = [m = metrics.get()](int64_t bytes, size_t regions) {
    m->SetSharedMemory(bytes, static_cast<int64_t>(regions));
  };
  metrics->SetSharedMemory(0, 0);
  shm = std::make_unique<SharedMemoryRegistry>(std::move(shared), CudaRegions(options.device));
  service = std::make_unique<AttentionServiceImpl>(*pipeline, *calls, *shm);
  oip_protocol =
      std::make_unique<OipProtocol>(*pipeline, *shm, static_cast<size_t>(options.kv.max_entries),
                                    std::chrono::duration_cast<SteadyClock::duration>(
                                        std::chrono::duration<double>(options.kv.ttl_seconds)));
  oip = std::make_unique<OipServiceImpl>(*oip_protocol, *calls);
  admin = std::make_unique<AdminServiceImpl>(*models, *calls, options.admin,
                                             [this] { return ReloadTenants(); });
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
  calls->sends().SetTimeout(Seconds(options.transport.send_timeout_seconds));
  quota = std::make_unique<grpc::ResourceQuota>("attnserve");  // Both listeners' connections.
  quota->Resize(static_cast<size_t>(options.transport.memory_bytes));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   ServerCredentials(options));
  Builder(builder, options.transport, *quota).AddListeningPort(options.address, credentials, &port);
  if (!options.unix_address.empty()) {
    ASSIGN_OR_RETURN(unix_listener,
                     UnixListener::Prepare(options.unix_address, options.unix_socket_mode));
    builder.AddListeningPort(unix_listener->BindAddress(), credentials);
  }
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
  if (grpc_server && port != 0) {
    // The Unix socket takes a quarter of --max-connections, TCP the rest: one bound for both.
    ConnectionLimits tcp = options.transport.limits, local = tcp;
    if (unix_listener) {
      local.max_connections = std::max<int64_t>(1, tcp.max_connections / 4);
      tcp.max_connections = std::max<int64_t>(1, tcp.max_connections - local.max_connections);
    }
    ConnectionGuard::Get().Guard(port, "gRPC", tcp, options.tls_cert_file.empty());
    if (!unix_listener) return Status::Ok();
    ConnectionGuard::Get().Guard(unix_listener->GuardKey(), "gRPC unix", local,
                                 options.tls_cert_file.empty());
    const Status published = unix_listener->Publish();
    if (published.ok()) return Status::Ok();
    grpc_server->Shutdown();
    return published;
  }
  return Refuse(
      "--address " + options.address +
      (unix_listener ? " (or unix:" + options.unix_address + ")" : std::string()) +
      ": cannot listen (in use, or not an address" +
      (options.tls_cert_file.empty() ? ")" : "; or --tls-cert and --tls-key do not match)"));
}

Status Server::Impl::StartHealth() {
  if (!options.health_address.empty()) {
    grpc::ServerBuilder builder;  // No services of its own: only the default health service.
    Builder(builder, options.transport, *quota)
        .AddListeningPort(options.health_address, grpc::InsecureServerCredentials(), &health_port);
    health_server = builder.BuildAndStart();
    if (!health_server || health_port == 0) {
      grpc_server->Shutdown();
      return Refuse("--health-address " + options.health_address +
                    ": cannot listen (in use, or not an address)");
    }
    ConnectionGuard::Get().Guard(health_port, "health", options.transport.limits, true);
  }
  std::vector<grpc::HealthCheckServiceInterface*> services;
  for (grpc::Server* s : {grpc_server.get(), health_server.get()}) {
    if (s != nullptr) services.push_back(s->GetHealthCheckService());
  }
  health = std::make_unique<HealthReporter>(std::move(services), *models->Snapshot());
  // Reloads tell metrics, health and the store what changed (on the reloading thread, which
  // Shutdown stops before the servers go).
  models->SetHooks(ReloadHooks(*metrics, *kv, *health));
  // Health says NOT_SERVING while the gRPC listener takes no connection.
  const std::string where =
      options.address.substr(0, options.address.rfind(':') + 1) + std::to_string(port);
  watch = std::make_unique<ListenerWatch>(
      options.address, port, [h = health.get(), address = where](bool accepting) {
        std::cerr << "attnserve: the gRPC listener on " << address
                  << (accepting ? " accepts connections again: health SERVING"
                                : " accepts no connection: health NOT_SERVING")
                  << std::endl;
        h->SetAccepting(accepting);
      });
  return Status::Ok();
}

Status Server::Impl::WarmUp() {
  if (options.warming_for_test) options.warming_for_test(port);
  const auto start = SteadyClock::now();
  // Through the batcher: the warm-up's batches run on the threads that will serve, as requests do.
  models->SetWarmRunner([b = batcher.get()](const std::shared_ptr<const AttentionModel>& model,
                                            const std::vector<const AttendCall*>& calls,
                                            const std::vector<AttendOutputs*>& outs) {
    return b->ComputeAndWait(model, calls, outs);
  });
  const Status warm = models->Warm();
  warmup_seconds = std::chrono::duration<double>(SteadyClock::now() - start).count();
  if (!warm.ok()) {
    grpc_server->Shutdown();
    if (health_server) health_server->Shutdown();
    return Refuse("warm-up: " + warm.message());
  }
  pipeline->SetWarming(false);
  health->Ready();
  return Status::Ok();
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() { Shutdown(); }

StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (IsCuda(options.device))
    impl->staging = std::make_shared<HostStaging>(options.staging_bytes, /*pinned=*/true);
  ASSIGN_OR_RETURN(impl->models, ModelRepository::Open(options.models_dir,
                                                       EngineOptionsOf(options, impl->staging),
                                                       WarmupOf(options)));
  if (options.models_loaded) options.models_loaded();
  RETURN_IF_ERROR(impl->PlanMemory());
  RETURN_IF_ERROR(impl->StartMetrics());
  impl->StartKv();
  RETURN_IF_ERROR(impl->StartTracing());
  impl->StartPipeline();
  RETURN_IF_ERROR(impl->ReloadTenants());
  RETURN_IF_ERROR(impl->StartGrpc());
  RETURN_IF_ERROR(impl->StartHttp());
  RETURN_IF_ERROR(impl->StartHealth());
  RETURN_IF_ERROR(impl->WarmUp());
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

int Server::port() const { return impl_->port; }
int Server::metrics_port() const { return impl_->metrics_port; }
int Server::health_port() const { return impl_->health_port; }
int Server::http_port() const { return impl_->http_port; }

Status Server::Impl::StartHttp() {
  if (options.http.address.empty()) return Status::Ok();
  oip_http = std::make_unique<OipHttp>(*oip_protocol, ATTNSERVE_VERSION);
  HttpOptions http_options = options.http;
  http_options.max_body_bytes = options.max_message_bytes;
  http_options.max_body_bytes_held = options.flow.max_inflight_bytes;
  // The same certificates as gRPC's (checked there first: both or neither of cert and key).
  if (!options.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(http_options.tls_cert_pem, ReadPem("--tls-cert", options.tls_cert_file));
    ASSIGN_OR_RETURN(http_options.tls_key_pem, ReadPem("--tls-key", options.tls_key_file));
    if (!options.tls_client_ca_file.empty()) {
      ASSIGN_OR_RETURN(http_options.tls_client_ca_pem,
                       ReadPem("--tls-client-ca", options.tls_client_ca_file));
    }
  }
  ASSIGN_OR_RETURN(http, HttpServer::Start(http_options, [this](HttpRequest&& r, HttpReply reply) {
                     oip_http->Handle(std::move(r), std::move(reply));
                   }));
  http_port = http->port();
  if (exposer) exposer->Register(std::make_shared<HttpMetrics>(http.get()));
  return Status::Ok();
}

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
  if (!impl_->options.unix_address.empty()) s += ", unix socket " + impl_->options.unix_address;
  if (impl_->http) {
    const std::string& h = impl_->options.http.address;
    s += ", HTTP on " + h.substr(0, h.rfind(':')) + ":" + std::to_string(impl_->http_port);
    if (!impl_->options.tls_cert_file.empty()) s += " (TLS)";
  }
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
  if (impl_->options.warmup) {
    s += ", warmed in " + std::to_string(static_cast<int>(impl_->warmup_seconds * 1e3)) + " ms";
  }
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
  const TracingOptions& t = impl_->options.tracing;
  if (impl_->exporter) {
    std::ostringstream rate;
    rate << t.rate;
    s += ", tracing to " + impl_->exporter->endpoint() + " (calls sampled by their caller, and " +
         rate.str() + " of the others)";
  }
  if (impl_->access_log) s += ", access log to " + (t.access_log == "-" ? "stdout" : t.access_log);
  return s;
}

std::string Server::MemoryWarning() const { return impl_->memory_plan.warning; }

std::shared_ptr<const ShutdownOutcome> Server::shutdown_outcome() const { return impl_->outcome; }

void Server::RequestReload() {
  const Status tenants = impl_->ReloadTenants();
  if (!tenants.ok()) {
    std::cerr << "attnserve: reload refused, nothing changed: " << tenants.message() << std::endl;
    return;
  }
  impl_->models->RequestReload(nullptr);
}

Status Server::Impl::ReloadTenants() {
  if (options.tenants_file.empty()) return Status::Ok();
  ASSIGN_OR_RETURN(std::shared_ptr<const Tenants> tenants, Tenants::Load(options.tenants_file));
  RETURN_IF_ERROR(tenants->CheckAgainst(kv->options().budget_bytes));
  pipeline->SetTenants(std::move(tenants));
  return Status::Ok();
}

}  // namespace attnserve
