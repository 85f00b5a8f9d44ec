// attnserve: serves multi-head attention over gRPC. `attnserve --help` lists the flags.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include "server/pipeline/host_cpus.h"
#include "server/process/host_memory.h"
#include "server/process/server.h"
#include "server/process/shutdown.h"
#include "server/process/unix_listener.h"

namespace {

// SIGHUP asks for a model reload and the server goes on. SIGINT/SIGTERM are handled, never left to
// their default action: threads created before main() (OpenBLAS's pool) do not block them, so a
// signal arriving while main() was not waiting for it (a second SIGTERM during the drain) used to
// kill the process mid-drain. The handler only writes the signal number to a pipe that main() reads
// (async-signal-safe).
int g_signal_pipe[2] = {-1, -1};
// Until start-up's models are loaded nothing listens and nothing is in flight: SIGINT/SIGTERM end
// the process there and then (exit 0), where a long load ran to its end first (a hostile review:
// still loading 48 s after a SIGTERM). Lock-free, so the handler may read it.
std::atomic<bool> g_loading{true};

// OpenTelemetry's environment variables, where the flags were not given.
const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// Traces and the access log (docs/tracing.md).
void AddTracingFlags(CLI::App& app, attnserve::TracingOptions& t) {
  app.add_option("--trace-endpoint", t.endpoint,
                 "OTLP/gRPC collector to export spans to: host:port, a host (port 4317), or an "
                 "http:// or https:// (TLS) URL; empty = tracing off (default: "
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT when set)");
  app.add_option("--trace-rate", t.rate,
                 "Fraction of calls without a sampled W3C traceparent that start a sampled trace; "
                 "0 = only calls that arrive sampled")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_flag("--trace-tls", t.tls, "TLS to the collector (implied by an https:// endpoint)");
  app.add_option("--trace-tls-ca", t.tls_ca_file,
                 "PEM CA bundle that signed the collector's certificate (default: system roots)");
  app.add_option("--trace-tls-cert", t.tls_cert_file,
                 "PEM client certificate for mutual TLS to the collector (with --trace-tls-key)");
  app.add_option("--trace-tls-key", t.tls_key_file, "PEM private key of --trace-tls-cert");
  app.add_option("--trace-service-name", t.service_name,
                 "The service.name of every span (default: OTEL_SERVICE_NAME, else attnserve)");
  app.add_option("--access-log", t.access_log,
                 "One JSON line per call (time, trace id, method, model, tokens, status, timings): "
                 "a file appended to, or - for standard output; empty = off")
      ->capture_default_str();
  app.add_option("--access-log-max-lines", t.access_log_max_lines,
                 "Lines the access log holds before it drops new ones (it never blocks a call)")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
}

// What the gRPC listeners' connections may hold, and for how long (docs/flags.md "Transport").
void AddTransportFlags(CLI::App& app, attnserve::TransportOptions& t) {
  attnserve::ConnectionLimits& c = t.limits;
  const auto count = [&app](const char* flag, int64_t& value, const char* what, int64_t most) {
    app.add_option(flag, value, what)->check(CLI::Range(int64_t{1}, most))->capture_default_str();
  };
  const auto seconds = [&app](const char* flag, double& value, const char* what) {
    app.add_option(flag, value, what)->check(CLI::Range(0.0, 1e6))->capture_default_str();
  };
  count("--max-connections", c.max_connections,
        "Client connections open at once on the gRPC listener (lowered to half the descriptors "
        "the process may open); beyond, a new one is closed as it is accepted",
        int64_t{1} << 24);
  count("--max-connections-per-peer", c.max_connections_per_peer,
        "The same from one peer address (behind a proxy: every client is the proxy's address)",
        int64_t{1} << 24);
  count("--max-concurrent-streams", c.h2.max_concurrent_streams,
        "Calls (HTTP/2 streams) open at once on one connection; a client that opens more, even "
        "before it acknowledged this setting, has its connection closed",
        int64_t{1} << 20);
  count("--max-streams-per-peer", c.max_streams_per_peer,
        "Calls open at once from one peer address over its connections (plaintext listeners)",
        int64_t{1} << 30);
  count("--max-streams", c.max_streams,
        "Calls open at once on the listener over all connections (plaintext listeners)",
        int64_t{1} << 30);
  app.add_option("--max-upload-bytes-per-peer", c.max_partial_bytes_per_peer,
                 "Bytes of request messages not yet whole from one peer address (plaintext "
                 "listeners; 0 = 8 x --max-message-bytes)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--max-upload-bytes", c.max_partial_bytes,
                 "Bytes of request messages not yet whole on the listener (plaintext listeners); "
                 "when full, its least recently active uploader's connection is shut (0 = 8 "
                 "x --max-message-bytes)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--transport-memory-bytes", t.memory_bytes,
                 "Memory gRPC's transport may hold for all connections (messages arriving or in "
                 "flight, read buffers); past it gRPC cancels streams (0 = --max-inflight-bytes + "
                 "8 x --max-message-bytes)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 50))
      ->capture_default_str();
  count("--max-header-bytes", c.h2.max_header_block_bytes,
        "Bytes of one call's header block as sent (HPACK-coded; plaintext listeners)",
        int64_t{1} << 24);
  seconds("--header-timeout-seconds", t.header_timeout_seconds,
          "Longest one header block may take to arrive whole (plaintext listeners)");
  count("--max-metadata-bytes", t.max_metadata_bytes,
        "Bytes of one call's metadata, decoded (gRPC's max_metadata_size)", int64_t{1} << 24);
  app.add_option("--max-resets-per-second", c.h2.resets_per_second,
                 "Calls one connection's client may cancel (RST_STREAM) in a second while it "
                 "cancels most of those it opens; beyond, its connection is closed (plaintext "
                 "listeners)")
      ->check(CLI::Range(1.0, 1e9))
      ->capture_default_str();
  seconds("--handshake-timeout-seconds", t.handshake_timeout_seconds,
          "Longest a new connection may take to finish TLS and send HTTP/2's settings");
  seconds("--max-connection-idle-seconds", t.max_connection_idle_seconds,
          "A connection with no call open this long is closed (GOAWAY); 0 = never");
  app.add_option("--transport-read-chunk-bytes", t.read_chunk_bytes,
                 "Bytes gRPC first reads from a connection at once (it adapts from there, and "
                 "shrinks under the transport's memory pressure)")
      ->check(CLI::Range(int64_t{256}, int64_t{64} << 20))
      ->capture_default_str();
  seconds("--send-timeout-seconds", t.send_timeout_seconds,
          "An answer its caller has not taken this long after it was sent is cancelled "
          "(during a stop, at most 40% of --shutdown-grace); 0 = never");
}

// Where the tracing flags were not given: OpenTelemetry's standard environment variables.
void ApplyTracingEnvironment(const CLI::App& app, attnserve::TracingOptions& t) {
  if (app.count("--trace-endpoint") == 0) {
    if (const char* e = Env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
      t.endpoint = e;
    else if (const char* e2 = Env("OTEL_EXPORTER_OTLP_ENDPOINT"))
      t.endpoint = e2;
  }
  if (app.count("--trace-service-name") == 0) {
    if (const char* n = Env("OTEL_SERVICE_NAME")) t.service_name = n;
  }
}

void OnSignal(int sig) {
  if ((sig == SIGINT || sig == SIGTERM) && g_loading.load()) {
    static const char kLine[] = "attnserve: stopped while loading models (nothing served yet)\n";
    (void)!write(STDOUT_FILENO, kLine, sizeof kLine - 1);
    _exit(0);
  }
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

void InstallSignals() {
  if (pipe(g_signal_pipe) != 0) {
    std::perror("attnserve: pipe");
    std::exit(1);
  }
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
}

int WaitSignal() {
  unsigned char b = 0;
  while (read(g_signal_pipe[0], &b, 1) != 1) {
    if (errno != EINTR) return SIGTERM;
  }
  return b;
}

// The flags into `options`; false when the process should exit now with *exit_code (--help, or
// a flag refused).
bool ParseFlags(int argc, char** argv, attnserve::ServerOptions* options, int* exit_code) {
  attnserve::ServerOptions& o = *options;
  CLI::App app{
      "attnserve: multi-head attention inference over gRPC, computed exactly as PyTorch's\n"
      "nn.MultiheadAttention. With no --models it serves the built-in `demo` model\n"
      "(embed_dim 512, 8 heads). Stops gracefully on SIGINT/SIGTERM; reloads --models on SIGHUP.",
      "attnserve"};
  app.add_option_function<std::vector<std::string>>(
         "--address",
         [&o](const std::vector<std::string>& addresses) {
           bool tcp = false;
           for (const std::string& a : addresses) {
             const bool unix_socket = a.rfind("unix:", 0) == 0;
             if (unix_socket && a.size() == 5)
               throw CLI::ValidationError("--address", "unix: needs a path (unix:PATH)");
             // gRPC's other schemes (unix-abstract:, vsock:, dns:, ...) are not guarded listeners.
             if (!unix_socket && (a.find("://") != std::string::npos || a.rfind("unix", 0) == 0 ||
                                  a.rfind("vsock:", 0) == 0 || a.rfind("dns:", 0) == 0 ||
                                  a.rfind("ipv4:", 0) == 0 || a.rfind("ipv6:", 0) == 0)) {
               throw CLI::ValidationError("--address", a + ": expected host:port or unix:PATH");
             }
             if (unix_socket ? !o.unix_address.empty() : tcp) {
               throw CLI::ValidationError("--address", a + ": expected at most one host:port and "
                                                           "one unix:PATH");
             }
             if (unix_socket) {
               o.unix_address = a.substr(5);
             } else {
               o.address = a;
               tcp = true;
             }
           }
         },
         "gRPC listen address: host:port (port 0 picks one; default 127.0.0.1:50051), and/or "
         "unix:PATH for a Unix domain socket beside it (repeat the flag for both)")
      ->expected(1, 2);
  app.add_option_function<std::string>(
         "--unix-socket-mode",
         [&o](const std::string& v) {
           const std::optional<int> mode = attnserve::ParseSocketMode(v);
           if (!mode) {
             throw CLI::ValidationError("--unix-socket-mode",
                                        v + ": expected octal permissions, 0 to 0777 (e.g. 0660)");
           }
           o.unix_socket_mode = *mode;
         },
         "The Unix domain socket's permissions, octal (who on this host may connect)")
      ->default_str("0660");
  app.add_option("--metrics-address", o.metrics_address,
                 "Prometheus /metrics listen address; empty to disable")
      ->capture_default_str();
  app.add_option("--http-address", o.http.address,
                 "The Open Inference Protocol over HTTP/REST (docs/api.md \"HTTP\"): host:port; "
                 "empty to disable")
      ->capture_default_str();
  app.add_option("--http-max-connections", o.http.max_connections,
                 "HTTP connections open at once; more are closed at once")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--http-max-connections-per-peer", o.http.max_connections_per_peer,
                 "HTTP connections from one peer address at once")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--http-idle-timeout", o.http.idle_timeout_seconds,
                 "An HTTP connection that sends nothing this long (seconds) is closed")
      ->check(CLI::Range(1.0, 86400.0))
      ->capture_default_str();
  app.add_option("--http-body-timeout", o.http.body_timeout_seconds,
                 "An HTTP request body not whole this long (seconds) after its headers is refused "
                 "and its connection closed")
      ->check(CLI::Range(1.0, 86400.0))
      ->capture_default_str();
  app.add_option("--models", o.models_dir,
                 "Directory of models: one subdirectory per model with config.json and weights "
                 "(docs/models.md \"Models\"); default: the built-in demo model");
  app.add_option("--device", o.device, "Compute device: cpu, cuda or cuda:N")
      ->capture_default_str();
  const std::map<std::string, attnserve::DType> dtypes{{"float32", attnserve::DType::kFloat32},
                                                       {"float16", attnserve::DType::kFloat16},
                                                       {"bfloat16", attnserve::DType::kBFloat16}};
  app.add_option(
         "--dtype", o.compute_dtype,
         "Weights and compute dtype: float32 (default, exact), bfloat16, or float16 (CUDA only)")
      ->transform(CLI::CheckedTransformer(dtypes).description("{float32, float16, bfloat16}"))
      ->default_str("float32");
  app.add_flag("--tf32", o.allow_tf32,
               "CUDA float32: let matmuls use TF32 tensor cores (faster, ~1e-3 relative error)");
  app.add_option("--tls-cert", o.tls_cert_file,
                 "PEM certificate chain: serve gRPC over TLS (with --tls-key)");
  app.add_option("--tls-key", o.tls_key_file, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", o.tls_client_ca_file,
                 "PEM CA certificate(s): require client certificates signed by it (mutual TLS)");
  app.add_option("--health-address", o.health_address,
                 "Second, plaintext listener serving only grpc.health.v1 (for probes that cannot "
                 "speak TLS); empty = none")
      ->capture_default_str();
  app.add_option("--advertise-address", o.advertise_address,
                 "host:port clients reach this replica at, named in every memory's and session's "
                 "handle so their calls come back here (e.g. the pod's IP behind a headless "
                 "Service); empty = --address when its host is not 0.0.0.0 or [::], else none")
      ->capture_default_str();
  app.add_option("--admin-token-file", o.admin.token_file,
                 "File holding a secret token: AdminService calls (ReloadModels) that send "
                 "'authorization: Bearer <token>' are allowed (read at each call)");
  app.add_option("--admin-client-names", o.admin.client_names,
                 "Client certificate names (CN or subject alternative name) allowed to call "
                 "AdminService; needs --tls-client-ca")
      ->delimiter(',');
  app.add_option("--tenants", o.tenants_file,
                 "JSON file of tenants and their terms: {\"default\": {...}, \"tenants\": "
                 "{\"NAME\": {...}}}, each with weight, max_queued_requests, kv_guaranteed_bytes, "
                 "kv_max_bytes (docs/tenants.md); reread with the models (SIGHUP, ReloadModels)");
  app.add_option("--tenant-header", o.tenant_header,
                 "Metadata key whose value names the tenant, trusted only behind a gateway that "
                 "sets it (e.g. attnserve-tenant); default: none, tenants are named only by their "
                 "verified client certificate, every other call is tenant 'default'");
  using Scheduling = attnserve::BatcherOptions::Scheduling;
  const std::map<std::string, Scheduling> schedulings{{"fair", Scheduling::kFair},
                                                      {"fcfs", Scheduling::kFcfs}};
  app.add_option("--scheduling", o.batcher.scheduling,
                 "Who goes next within a priority level: fair = the waiting tenant with the least "
                 "weighted work served (FLOPs), fcfs = the oldest request")
      ->transform(CLI::CheckedTransformer(schedulings).description("{fair, fcfs}"))
      ->default_str("fair");
  app.add_option("--priority-levels", o.batcher.priorities.levels,
                 "Priority levels of models whose config.json sets none (0: priorities ignored); "
                 "a request's priority 1 is served first")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--default-priority-level", o.batcher.priorities.default_level,
                 "Level of requests that give priority 0 (0: the lowest level)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  std::vector<std::string> queue_policies;
  app.add_option("--queue-policy", queue_policies,
                 "A level's queue (repeatable): LEVEL:key=value,... or default:key=value,... with "
                 "max_queue_size, default_timeout_microseconds, allow_timeout_override, "
                 "timeout_action (REJECT or DELAY); a level starts from the default given before "
                 "it");
  using Varlen = attnserve::EngineOptions::Varlen;
  const std::map<std::string, Varlen> varlens{
      {"auto", Varlen::kAuto}, {"off", Varlen::kOff}, {"emulate", Varlen::kEmulate}};
  app.add_option("--varlen-attention", o.varlen,
                 "Small requests batched together: auto = one varlen flash/memory-efficient kernel "
                 "launch over their packed rows on CUDA (LibTorch >= 2.11), else one attention per "
                 "request; off = one per request; emulate = the varlen packing with per-sequence "
                 "attention on any device (for tests)")
      ->transform(CLI::CheckedTransformer(varlens).description("{auto, off, emulate}"))
      ->default_str("auto");
  app.add_option("--workers", o.batcher.workers,
                 "Compute threads (default: one per usable core: CPU affinity, capped by a cgroup "
                 "CPU quota; on CUDA 4)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--max-queue-size", o.batcher.max_queue_size,
                 "Requests that may wait for compute; beyond it new ones get RESOURCE_EXHAUSTED")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-queued-per-caller", o.batcher.max_queued_per_caller,
                 "Requests one caller (a tenant without its own max_queued_requests, or with "
                 "--fair-by-peer a peer address) may have waiting at once (0 = no bound of its "
                 "own; in a full queue the caller holding the most gives up its newest request "
                 "to another caller's either way)")
      ->check(CLI::Range(size_t{0}, size_t{1} << 24))
      ->capture_default_str();
  app.add_option("--fair-by-peer", o.fair_by_peer,
                 "Tell calls that name no tenant apart by their peer address for fair shares and "
                 "the per-caller bounds (false: all are the tenant default, e.g. behind a proxy "
                 "without --tenant-header)")
      ->capture_default_str();
  bool no_warmup = false;
  app.add_flag("--no-warmup", no_warmup,
               "Serve at once, cold: the first requests make the kernels (default: every model is "
               "warmed for the shapes its batches take before health says SERVING)");
  bool no_batching = false;
  app.add_flag("--no-batching", no_batching,
               "Compute every request on its own, at once (default: dynamic batching)");
  app.add_option("--max-batch-tokens", o.batcher.max_batch_tokens,
                 "Most tokens one batch packs together: query tokens, plus key tokens of "
                 "cross-attention requests (on CUDA 16384)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-shared-request-tokens", o.batcher.max_shared_request_tokens,
                 "Requests with more tokens are computed alone, at once (on CUDA: "
                 "--max-batch-tokens, every request shares)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-batch-attention", o.batcher.max_batch_attention,
                 "Most attention cost in one batch: sum of batch * query_len * key_len (on CUDA "
                 "2^32)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  int64_t delay_us = o.batcher.max_queue_delay.count();
  app.add_option("--max-queue-delay-us", delay_us,
                 "Longest the oldest request waits for company before its batch closes, in us")
      ->check(CLI::Range(int64_t{0}, int64_t{10000000}))
      ->capture_default_str();
  app.add_option("--max-message-bytes", o.max_message_bytes,
                 "Largest gRPC message received or sent, in bytes (unset: lowered to fit a "
                 "container's memory limit, docs/shutdown.md \"Memory\")")
      ->check(CLI::Range(1 << 20, 1 << 30))
      ->capture_default_str();
  app.add_option("--max-request-tokens", o.limits.max_tokens,
                 "Most tokens in one request: batch * query_len, plus batch * key_len for "
                 "cross-attention")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-steps-per-call", o.limits.max_steps,
                 "Most entries in one batched step (AttendRequest.steps): sessions or memories "
                 "stepped in one call")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}))
      ->capture_default_str();
  app.add_option("--max-attention-scores", o.limits.max_attention_scores,
                 "Most attention scores in one request: batch * heads * query_len * key_len")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--staging-bytes", o.staging_bytes,
                 "CUDA: most pinned host memory held at once by copies to and from the GPU (a "
                 "batch's inputs and answers on their way); past it a batch copies through "
                 "pageable memory (unset: lowered to fit a container's memory limit; unused on the "
                 "CPU)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_flag("--allow-shared-memory", o.shared_memory.allowed,
               "Let clients on this host register POSIX shared memory regions (the Open Inference "
               "Protocol's shared-memory extension) and send and receive tensors through them: "
               "a local process then hands the server memory (default: off)");
  app.add_option("--shared-memory-bytes", o.shared_memory.max_bytes,
                 "Most bytes of shared memory registered at once, over every region")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--shared-memory-uids", o.shared_memory.allowed_uids,
                 "Owners (uids, comma-separated) whose shared memory objects clients may register "
                 "besides the server's own uid (default: none; an object of any other owner is "
                 "refused with PERMISSION_DENIED)")
      ->delimiter(',');
  app.add_flag("--shared-memory-remote-peers", o.shared_memory.remote_peers,
               "Let callers that are not on this host (neither loopback nor a unix socket) "
               "register shared memory too, e.g. behind a proxy on the same host (default: off; "
               "their registrations are refused with PERMISSION_DENIED)");
  app.add_option("--max-inflight-bytes", o.flow.max_inflight_bytes,
                 "Most request plus answer bytes (at the width they are computed in) held for all "
                 "requests in flight; beyond it new requests get RESOURCE_EXHAUSTED (unset: "
                 "lowered to fit a container's memory limit)")
      ->check(CLI::Range(int64_t{1} << 20, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--max-inflight-bytes-per-caller", o.flow.max_inflight_bytes_per_caller,
                 "The same bound for one caller: a tenant, or with --fair-by-peer a peer address "
                 "(0 = half of --max-inflight-bytes)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--max-stream-inflight", o.flow.max_stream_requests,
                 "Unanswered requests one AttendStream may have; at the limit the server stops "
                 "reading it until the client takes answers")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--max-stream-inflight-bytes", o.flow.max_stream_bytes,
                 "The same per-stream bound in request plus answer bytes")
      ->check(CLI::Range(int64_t{1} << 16, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--kv-budget-bytes", o.kv.budget_bytes,
                 "Device bytes all memories and decoding sessions together may hold; the least "
                 "recently used ones not in use are evicted to make room (unset: lowered to fit a "
                 "container's memory limit)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--kv-max-entry-bytes", o.kv.max_entry_bytes,
                 "Device bytes one memory or session may hold (a session grows as it decodes; "
                 "unset: at most --kv-budget-bytes)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option(
         "--kv-max-entries", o.kv.max_entries,
         "Memories and sessions held at once; beyond it CreateMemory and OpenSession are "
         "refused with RESOURCE_EXHAUSTED (each entry costs ~1 KiB outside the byte budget)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  app.add_option("--kv-ttl-seconds", o.kv.ttl_seconds,
                 "A memory or session unused this long expires")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option(
         "--shutdown-grace", o.shutdown_grace_seconds,
         "Seconds in-flight requests get to finish on SIGINT/SIGTERM; the process exits 1 when "
         "it cuts any, 0 when every call was answered")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--lingering-close", o.lingering_close,
                 "On stop, close each client connection only once its client has read everything "
                 "(false: close as gRPC does, e.g. behind a proxy that buffers whole answers)")
      ->capture_default_str();
  AddTracingFlags(app, o.tracing);
  AddTransportFlags(app, o.transport);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    *exit_code = app.exit(e);
    return false;
  }
  ApplyTracingEnvironment(app, o.tracing);
  for (const std::string& spec : queue_policies) {
    const attnserve::Status st = attnserve::ParseQueuePolicyFlag(spec, &o.batcher.priorities);
    if (!st.ok()) {
      std::cerr << "attnserve: error: " << st.message() << "\n";
      *exit_code = 2;
      return false;
    }
  }
  o.memory_given = {app.count("--kv-budget-bytes") > 0, app.count("--kv-max-entry-bytes") > 0,
                    app.count("--max-inflight-bytes") > 0, app.count("--max-message-bytes") > 0,
                    app.count("--staging-bytes") > 0};
  o.batcher.enabled = !no_batching;
  // Budgets not given follow the device (docs/hardware.md "GPU defaults").
  o.batcher = o.batcher.ForDevice(
      o.device, {app.count("--max-batch-tokens") > 0, app.count("--max-shared-request-tokens") > 0,
                 app.count("--max-batch-attention") > 0, app.count("--workers") > 0});
  o.warmup = !no_warmup;
  o.batcher.max_queue_delay = std::chrono::microseconds(delay_us);

  return true;
}

// Starts the server and serves until SIGINT/SIGTERM (SIGHUP: a reload), then stops.
int Serve(attnserve::ServerOptions o) {
  InstallSignals();
  attnserve::KeepMessageBuffers();
  o.models_loaded = [] { g_loading = false; };
  auto server = attnserve::Server::Start(o);
  if (!server.ok()) {
    std::cerr << "attnserve: error: " << server.status().message() << "\n";
    return 2;
  }
  std::cout << (*server)->Describe() << std::endl;
  if (const std::string warning = (*server)->MemoryWarning(); !warning.empty())
    std::cerr << warning << std::endl;
  int sig = 0;
  while ((sig = WaitSignal()) == SIGHUP) {
    std::cout << "attnserve: SIGHUP: reloading --models in the background" << std::endl;
    (*server)->RequestReload();
  }
  std::cout << "attnserve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM")
            << ": draining in-flight requests" << std::endl;
  attnserve::StopProcess(**server, o.shutdown_grace_seconds);
}

}  // namespace

int main(int argc, char** argv) {
  attnserve::ServerOptions options;
  int exit_code = 0;
  if (!ParseFlags(argc, argv, &options, &exit_code)) return exit_code;
  return Serve(options);
}
