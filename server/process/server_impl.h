#pragma once
// The parts of a running Server, shared by its start (server.cc) and its stop (shutdown.cc).
// Private to the process room.

#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>

#include <memory>
#include <mutex>

#include "server/grpc/call_counter.h"
#include "server/grpc/health.h"
#include "server/http/http_server.h"
#include "server/http/oip_http.h"
#include "server/oip/oip_service.h"
#include "server/pipeline/metrics.h"
#include "server/pipeline/request_pipeline.h"
#include "server/process/listener_watch.h"
#include "server/process/memory_plan.h"
#include "server/process/memory_sampler.h"
#include "server/process/metrics_listener.h"
#include "server/process/server.h"
#include "server/process/socket_linger.h"
#include "server/process/unix_listener.h"
#include "server/trace/access_log.h"
#include "server/trace/otlp_exporter.h"
#include "server/trace/tracer.h"
#include "server/v1/attention_service.h"

namespace attnserve {

inline std::shared_ptr<ShutdownOutcome> MakeOutcome(std::shared_ptr<const CallCounter> calls) {
  auto outcome = std::make_shared<ShutdownOutcome>();
  outcome->calls = std::move(calls);
  return outcome;
}

struct Server::Impl {
  ServerOptions options;
  // CUDA: the pinned staging every model's copies share (null on the CPU); made before the models.
  std::shared_ptr<HostStaging> staging;
  std::unique_ptr<ModelRepository> models;
  std::unique_ptr<AdminServiceImpl> admin;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<MetricsListener> exposer;
  std::unique_ptr<MemorySampler> memory;
  // Spans and access-log lines: made before the pipeline and the batcher, gone after them.
  std::unique_ptr<OtlpExporter> exporter;
  std::unique_ptr<Tracer> tracer;
  std::unique_ptr<AccessLog> access_log;
  std::unique_ptr<Batcher> batcher;
  std::unique_ptr<KvStore> kv;
  // Shared-memory regions clients registered; cleared at the stop, after the drain.
  std::unique_ptr<SharedMemoryRegistry> shm;
  std::unique_ptr<RequestPipeline> pipeline;
  std::unique_ptr<AttentionServiceImpl> service;
  // The Open Inference Protocol's shared operations (sequences), and its gRPC front end.
  std::unique_ptr<OipProtocol> oip_protocol;
  std::unique_ptr<OipServiceImpl> oip;
  // The protocol over HTTP: its routes and its listener (stopped before gRPC at the stop).
  std::unique_ptr<OipHttp> oip_http;
  std::unique_ptr<HttpServer> http;
  int http_port = 0;
  // Shared with the shutdown outcome; declared before the servers, so it outlives their calls.
  std::shared_ptr<CallCounter> calls = std::make_shared<CallCounter>();
  std::shared_ptr<ShutdownOutcome> outcome = MakeOutcome(calls);
  // gRPC's resource quota for every listener's connections (TransportOptions::memory_bytes).
  std::unique_ptr<grpc::ResourceQuota> quota;
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<grpc::Server> health_server;  // --health-address: grpc.health.v1 only, plaintext
  std::unique_ptr<HealthReporter> health;
  std::unique_ptr<ListenerWatch> watch;  // Health's view of whether the gRPC listener accepts.
  SocketLinger linger;                   // The client connections, held while the server stops.
  int port = 0;
  std::unique_ptr<UnixListener> unix_listener;  // --address unix:PATH (null: none).
  int health_port = 0;
  int metrics_port = 0;
  std::once_flag shutdown_once;
  MemoryPlan memory_plan;
  double warmup_seconds = 0;

  Status PlanMemory();
  Status StartMetrics();
  void StartKv();
  Status StartTracing();
  void StartPipeline();
  // Reads --tenants again and gives it to the pipeline; its failure changes nothing.
  Status ReloadTenants();
  Status StartGrpc();
  Status StartHttp();
  Status StartHealth();
  // Warms the models while health says NOT_SERVING, then says SERVING.
  Status WarmUp();
  void StopGrpc(SteadyClock::time_point cut_at, SteadyClock::time_point backstop);
  // Holds the client connections not held yet, for the lingering close (when it is on).
  void HoldConnections();
};

}  // namespace attnserve
