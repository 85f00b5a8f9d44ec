#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "server/core/status.h"
#include "server/core/types.h"
#include "server/grpc/call_counter.h"
#include "server/http/http_server.h"
#include "server/kv/kv_store.h"
#include "server/pipeline/batcher.h"
#include "server/pipeline/request_pipeline.h"
#include "server/process/connection_guard.h"
#include "server/process/memory_plan.h"
#include "server/shm/shared_memory.h"
#include "server/v1/admin_service.h"

namespace attnserve {

/// Everything `attnserve` can be told on its command line; defaults are the flags' defaults.
/// Traces and the access log (docs/tracing.md; server flags --trace-*, --access-log).
struct TracingOptions {
  /// The OTLP/gRPC collector: host:port, a host alone (port 4317), or an http:// (plaintext) or
  /// https:// (TLS) URL as OTEL_EXPORTER_OTLP_ENDPOINT writes it. "" = tracing off: no trace
  /// context is read and no span is made.
  std::string endpoint;
  /// Calls without a sampled parent that start a sampled trace: 0 = only calls that arrive sampled.
  double rate = 0;
  /// TLS to the collector (also implied by an https:// endpoint): its CA bundle ("" = the system's
  /// roots) and a client certificate and key for mutual TLS.
  bool tls = false;
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  /// The service.name resource attribute (OTEL_SERVICE_NAME when the flag is not given).
  std::string service_name = "attnserve";
  /// One JSON line per call: "" = off, "-" = standard output, else a file appended to.
  std::string access_log;
  /// Lines the access log may hold before it drops (it never blocks a call).
  size_t access_log_max_lines = 10000;
};

/// What the gRPC listeners let their connections hold, and for how long (docs/flags.md "Transport";
/// server flags --max-connections ...). gRPC 1.51 keeps none of these by default.
struct TransportOptions {
  /// Connections, streams, header blocks, uploads and resets (the connection guard's bounds; its
  /// h2.max_message_bytes follows --max-message-bytes).
  ConnectionLimits limits;
  /// gRPC's resource quota: the bytes its transport may hold for the listeners' connections
  /// (messages arriving and those handed to handlers, read buffers); past it gRPC cancels streams
  /// to free memory (--transport-memory-bytes; 0: --max-inflight-bytes plus kArrivingMessages
  /// messages of --max-message-bytes, the memory plan's terms).
  int64_t memory_bytes = 0;
  /// Longest one header block may take to arrive whole (the inspector's header_timeout).
  double header_timeout_seconds = 10;
  /// A connection must finish its TLS handshake and send HTTP/2's settings within this long.
  double handshake_timeout_seconds = 10;
  /// A connection with no call open this long is sent GOAWAY and closed (0: never).
  double max_connection_idle_seconds = 300;
  /// A call's metadata (headers), decoded, at most this many bytes (gRPC's max_metadata_size).
  int64_t max_metadata_bytes = 16 << 10;
  /// An answer (or a stream's message) its caller has not taken this long after it was handed to
  /// gRPC is cancelled: a caller that never reads holds no memory for longer (0: never). During a
  /// stop, at most 40% of --shutdown-grace.
  double send_timeout_seconds = 30;
  /// The bytes gRPC first reads from a connection at once (GRPC_ARG_TCP_READ_CHUNK_SIZE; its own
  /// default 8 KiB): a 2 MB message arrives in a few reads instead of hundreds. It adapts to what
  /// arrives from then on, and under the resource quota's pressure shrinks to a few hundred bytes.
  int64_t read_chunk_bytes = 2 << 20;
};

struct ServerOptions {
  std::string address = "127.0.0.1:50051";  ///< gRPC listen address; port 0 picks one.
  /// A Unix domain socket the same services listen on besides `address` ("": none), for callers
  /// on this host (docs/api.md "Unix domain socket"): created (an old socket there replaced) with
  /// `unix_socket_mode`; its connections are guarded as one peer ("unix").
  std::string unix_address;
  int unix_socket_mode = 0660;
  std::string metrics_address = "127.0.0.1:9464";  ///< /metrics listen address; "" disables.
  /// The Open Inference Protocol over HTTP/REST (docs/api.md "HTTP"): its address ("" off) and
  /// bounds; its bodies are bounded by max_message_bytes.
  HttpOptions http;
  std::string models_dir;  ///< "" serves the built-in demo model.
  /// Called once start-up's models are loaded, before anything listens (none: nothing called).
  /// main's signal handler ends the process at once until then: a stop during a long load has
  /// nothing in flight to drain.
  std::function<void()> models_loaded;
  std::string device = "cpu";
  DType compute_dtype = DType::kFloat32;  ///< Weights and compute (CUDA: any float).
  bool allow_tf32 = false;                ///< CUDA float32 matmuls on TF32 tensor cores.
  /// CUDA: most pinned host memory the copies to and from the GPU hold at once (batches' inputs
  /// and answers on their way; HostStaging). Unused on the CPU. Counted in the memory plan.
  int64_t staging_bytes = EngineOptions::kDefaultStagingBytes;
  EngineOptions::Varlen varlen =
      EngineOptions::Varlen::kAuto;  ///< Batched small requests' attention.
  BatcherOptions batcher;            ///< Batching, queue and compute threads.
  int max_message_bytes = 64 << 20;  ///< gRPC send/receive limit.
  AttendLimits limits;               ///< max_answer_bytes follows max_message_bytes.
  FlowLimits flow;                   ///< Bytes in flight; per-stream backpressure.
  KvOptions kv;                      ///< Memories and decoding sessions: budget, TTL.
  /// Regions of shared memory clients on this host may register (off unless allowed).
  SharedMemoryOptions shared_memory;
  MemoryFlagsGiven memory_given;       ///< The rest follow the container's memory limit.
  double shutdown_grace_seconds = 30;  ///< In-flight requests get this long to finish.
  TransportOptions transport;          ///< What connections may hold.
  /// On stop, client connections are held until their clients have read everything (SocketLinger;
  /// needs process/interposers.cc in the executable). Off: they close as gRPC closes them, for a
  /// deployment behind a proxy that buffers whole answers anyway.
  bool lingering_close = true;
  /// TLS on --address: PEM certificate chain and key; with client_ca_file, clients must present a
  /// certificate signed by it (mutual TLS). All empty: plaintext.
  std::string tls_cert_file, tls_key_file, tls_client_ca_file;
  /// A second listener, always plaintext, that serves only grpc.health.v1 (the same statuses as
  /// --address): for probes that cannot speak TLS, such as Kubernetes' gRPC probes. "" = none.
  std::string health_address;
  /// The host:port clients reach this replica at, named in each memory's and session's KvHandle so
  /// that clients send its calls here. "" = --address when its host is a concrete one (not
  /// 0.0.0.0 or [::]; port 0 becomes the bound port), else none.
  std::string advertise_address;
  /// Warm every model at start (and each version a reload loads) for the shapes its batches will
  /// take, before health says SERVING: the first requests are then as fast as the rest. Off: the
  /// server is ready at once and its first requests make the kernels (--no-warmup).
  bool warmup = true;
  /// Tests: runs on the starting thread once everything listens and health says NOT_SERVING,
  /// before the warm-up. Null in production.
  std::function<void(int port)> warming_for_test;
  /// Who may call AdminService.ReloadModels (token file, client certificate names); none: nobody.
  AdminAuth admin;
  /// Who shares the server on what terms (docs/tenants.md): the tenants file (--tenants; "":
  /// every tenant on default terms), reread with the models; and the metadata key whose value
  /// names the tenant behind a gateway that authenticates (--tenant-header; "": none).
  std::string tenants_file, tenant_header;
  /// Calls that name no tenant are told apart by their peer address for fair shares and the
  /// per-caller bounds (--max-queued-per-caller, --max-inflight-bytes-per-caller): one address
  /// cannot take the queue or the in-flight budget from the others (--fair-by-peer). Off: they are
  /// all `default`, as behind a proxy that names no tenant they are anyway.
  bool fair_by_peer = true;
  TracingOptions tracing;
};

/// What a shutdown had to cut; shared, so that a watchdog may read it while the server goes.
struct ShutdownOutcome {
  /// Connections closed at the end of the grace period with bytes their clients had not yet read
  /// (an answer may be cut short); 0 when everything written was read.
  std::atomic<int64_t> connections_unread{0};
  /// Client connections held for a lingering close (0 with lingering close off).
  std::atomic<int64_t> connections_held{0};
  /// The calls attnserve took and has not finished, and those the stop cut.
  std::shared_ptr<const CallCounter> calls;

  /// The calls the grace period cut (their clients got CANCELLED or UNAVAILABLE), counting those
  /// still open, which an exit now would cut; before the grace period ends, those open. 0 when
  /// every call taken was answered.
  int64_t calls_cut() const { return calls->cut(); }
};

/// A running attnserve: models loaded, gRPC and metrics listening. Thread-safe.
class Server {
 public:
  /// Loads the models and starts listening. FAILED_PRECONDITION (with the file, flag or address
  /// at fault) when anything is wrong: nothing is served half-broken.
  static StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();  ///< Shuts down if still running.

  /// The bound gRPC port (useful with port 0).
  int port() const;
  /// The bound --health-address port, or 0 without one.
  int health_port() const;
  /// The bound metrics port, or 0 when metrics are disabled.
  int metrics_port() const;
  /// The bound --http-address port, or 0 when HTTP is off.
  int http_port() const;
  /// The start-up log line: models, addresses, device, LibTorch version, the memory limit and the
  /// budgets sized to it.
  std::string Describe() const;
  /// A warning for the log, or "": memory budgets given as flags that may not fit the limit.
  std::string MemoryWarning() const;
  /// Rescans --models in the background, as AdminService.ReloadModels does (SIGHUP); the outcome
  /// goes to the log, the metrics and health.
  void RequestReload();
  /// Graceful shutdown within the grace period: health goes NOT_SERVING; new requests (unary, or on
  /// open streams) get UNAVAILABLE while accepted ones finish and every stream is finished; then
  /// gRPC stops (cancelling whatever is left at 90% of the grace period; connections with no call
  /// left are closed at once, health watches cut), the queue drains and the engine is released.
  /// Idempotent; shutdown_outcome() then says what was cut.
  void Shutdown();
  std::shared_ptr<const ShutdownOutcome> shutdown_outcome() const;

 private:
  struct Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve
