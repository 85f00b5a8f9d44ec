#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/tensor.h"

namespace attnserve {

/// A call's outcome: `code` is a gRPC status code (0 = OK), `message` says what was wrong.
struct CallStatus {
  int code = 0;
  std::string message;
  /// A failed call's trace id when the server traces (its `attnserve-trace-id` trailing metadata;
  /// an AttendStream request's Error.trace_id); "" otherwise.
  std::string trace_id;
  bool ok() const { return code == 0; }
  /// "INVALID_ARGUMENT: key: shape [2, 7] has 2 dims, ..." or "OK".
  std::string ToString() const;
};

/// gRPC status code names, e.g. 3 -> "INVALID_ARGUMENT".
const char* StatusCodeName(int code);

/// Which attention weights to return.
enum class AttnWeights { kNone = 0, kAveraged = 1, kPerHead = 2 };

/// Layout of query, key, value and output.
enum class Layout { kBatchFirst = 1, kSequenceFirst = 2 };

/// One entry of a batched step (AttendRequest::steps): a session's step or a memory's query.
struct Step {
  std::string session;  ///< A session's handle, or
  std::string memory;   ///< a memory's.
  Tensor query;         ///< [B, T, E] batch-first (or [T, E]); one token or more.
  /// With `session`: the tokens it should hold before this step (else this entry is ABORTED).
  std::optional<int64_t> session_length;
  /// Rotary models: the first token's position (unset: the session's length), or every token's own.
  std::optional<int64_t> query_position;
  std::vector<int64_t> positions;
  std::optional<Tensor> key_padding_mask;  ///< [B, T], for a session's new tokens.
};

/// One entry's answer in a batched step (AttendResult::steps), in the request's order.
struct StepResult {
  CallStatus status;           ///< This entry's own outcome; a failed entry changed nothing.
  Tensor output;               ///< [B, T, E]; empty when it failed.
  int64_t session_length = 0;  ///< A session's tokens after this step.
};

/// The arguments of nn.MultiheadAttention.forward (see proto/attnserve/v1/attention.proto for every
/// shape). Bool masks: true = masked out.
struct AttendRequest {
  std::string model = "demo";
  Tensor query;               ///< [B, Lq, E] (batch-first), [Lq, B, E], or [Lq, E]
  std::optional<Tensor> key;  ///< Absent with value: self-attention.
  std::optional<Tensor> value;
  std::optional<Tensor> key_padding_mask;  ///< [B, Lk]
  std::optional<Tensor> attn_mask;         ///< [Lq, Lk] or [B*H, Lq, Lk]
  bool is_causal = false;
  AttnWeights attn_weights = AttnWeights::kNone;
  Layout layout = Layout::kBatchFirst;
  uint64_t request_id = 0;
  int64_t model_version = 0;  ///< A version of `model`; 0 = the highest loaded.
  /// A memory's handle (Client::CreateMemory): cross-attention against its keys and values; no
  /// key, value or key_padding_mask then. With a memory or session, `model` is not sent (the handle
  /// names its model; model_version, when not 0, must be its).
  std::string memory;
  /// A session's handle (Client::OpenSession): `query` holds the step's new tokens, appended to the
  /// session, attending causally over all so far; key_padding_mask [B, T] covers the new tokens.
  std::string session;
  /// With `session`: the tokens the session should hold before this step (else ABORTED); unset:
  /// not checked.
  std::optional<int64_t> session_length;
  /// This request's own W3C trace context, for a request on an AttendStream (where the call's
  /// CallOptions::traceparent covers the whole stream); empty: none.
  std::string traceparent, tracestate;
  /// Write the output (and the attention weights) into these shared-memory regions instead of
  /// the answer's message; AttendResult's tensors then carry dtype and shape, no data.
  std::optional<SharedMemoryRef> output_shared_memory, attn_weights_shared_memory;
  /// The priority level when the model has levels (docs/tenants.md): 1 first; 0 the default.
  uint64_t priority = 0;
  /// Most microseconds the request may wait to start, where the level's policy lets a request
  /// shorten its timeout; 0: the level's own.
  uint64_t queue_timeout_us = 0;
  /// Models from a decoder checkpoint (ModelInfo::rotary_theta > 0): the first query token's
  /// position (token i at query_position + i); unset: 0, or in a session step its length.
  std::optional<int64_t> query_position;
  /// Cross-attention on such a model: the first key token's position.
  int64_t key_position = 0;
  /// Instead of query_position: every query token's own, batch * query_len values, batch-first.
  std::vector<int64_t> positions;
  /// A batched step (docs/api.md "Many sessions in one call"): one step for each of many sessions
  /// (or one query for each of many memories) of one model version, computed together and
  /// answered in AttendResult::steps in order; the request then carries no query, handle, masks
  /// or positions of its own (its `model` is not sent). An entry that fails answers its own
  /// status; the others go on. The call goes to the replica of the first entry's handle.
  std::vector<Step> steps;
};

/// A registered shared-memory region (Client::SharedMemoryStatus).
struct SharedMemoryRegionInfo {
  std::string name, key;
  uint64_t offset = 0, byte_size = 0;
};

/// A successful answer.
struct AttendResult {
  Tensor output;
  std::optional<Tensor> attn_weights;
  uint64_t request_id = 0;
  std::string model;
  int64_t model_version = 0;       ///< The version of `model` that computed it.
  std::string weights_hash;        ///< The weights that computed it (ModelInfo::weights_hash).
  double queue_seconds = 0;        ///< Server-side wait before compute.
  double compute_seconds = 0;      ///< Server-side compute.
  uint32_t batch_size = 0;         ///< Requests computed together with this one.
  uint32_t previous_attempts = 0;  ///< Failed attempts the retry policy made before this answer.
  int64_t session_length = 0;      ///< With a session: the tokens it holds after this step.
  /// A batched step's answers, one per entry of AttendRequest::steps, in order.
  std::vector<StepResult> steps;
};

/// A memory or session kept on the server (KvHandle).
struct KvInfo {
  std::string handle;  ///< 32 hex digits; name it in AttendRequest::memory or ::session.
  std::string model;
  int64_t model_version = 0;
  std::string weights_hash;
  int64_t batch = 0;
  int64_t length = 0;      ///< Tokens held per sequence.
  int64_t bytes = 0;       ///< Server memory held.
  double ttl_seconds = 0;  ///< Expires this long after its last use.
  /// The replica holding it, as it advertises itself (server flag --advertise-address); "" when
  /// it advertises none. The Client that made it sends its calls there (ClientOptions::
  /// route_to_replica).
  std::string replica;
};

/// CreateMemory's inputs: key and value in `layout`, optional key padding.
struct MemoryRequest {
  std::string model = "demo";
  int64_t model_version = 0;
  Tensor key, value;                       ///< [B, Lk, kdim], [B, Lk, vdim] (or unbatched)
  std::optional<Tensor> key_padding_mask;  ///< [B, Lk]
  Layout layout = Layout::kBatchFirst;
  int64_t key_position = 0;  ///< Models from a decoder checkpoint: the first key's position.
};

/// What a loaded model is.
struct ModelInfo {
  std::string name;
  int64_t embed_dim = 0, num_heads = 0, kdim = 0, vdim = 0;
  bool bias = false, add_bias_kv = false, add_zero_attn = false;
  DataType compute_dtype = DataType::kFloat32;
  std::string device;
  std::string weights_hash;
  std::string source;
  int64_t version = 1;  ///< N for DIR/name/N/ on the server; 1 for an unversioned model.
  /// A layer of a decoder checkpoint (docs/models.md): family ("" for nn.MultiheadAttention),
  /// layer, key/value heads, head width, RoPE (theta 0: none), window (0: none), q/k norm, scale.
  std::string family;
  int64_t layer = 0, num_kv_heads = 0, head_dim = 0, rotary_dim = 0, sliding_window = 0;
  double rotary_theta = 0, scale = 0;
  std::string rope_type;
  bool qk_norm = false;
};

/// What a reload did to one version of one model (AdminService.ReloadModels).
struct ModelChange {
  std::string name;
  int64_t version = 0;       ///< 0: the model's directory as a whole.
  std::string action;        ///< "loaded", "updated", "unloaded" or "failed".
  std::string weights_hash;  ///< Serving under this name and version now; "" when none.
  std::string message;       ///< "failed": why, naming the file.
};

/// A reload's outcome: what changed, and how many versions serve now.
struct ReloadResult {
  std::vector<ModelChange> changes;
  int models_served = 0;
  bool any_failed() const;
};

/// The gRPC service config a Client uses unless told otherwise: round_robin over every address the
/// target resolves to, skipping replicas whose grpc.health.v1 status for the service is not SERVING
/// (a draining replica says so first), and up to 5 attempts of any AttentionService call (or Open
/// Inference Protocol call, inference.GRPCInferenceService) that fails
/// with UNAVAILABLE or CANCELLED, backing off from 50 ms. CANCELLED is retried because gRPC itself
/// answers it to a call that reaches a server already stopping (the call was not processed); a
/// call the client cancels is never retried. The same JSON is deploy/grpc/service-config.json, for
/// clients in other languages.
extern const char* const kDefaultServiceConfig;
/// The service config for a target that is a proxy (nginx, Envoy) in front of the replicas: the
/// same retries, no client-side health checking (through a proxy it would watch whichever replica
/// the proxy chose for the watch, and turn the whole proxy unhealthy when that one drains).
/// deploy/grpc/service-config-proxy.json.
extern const char* const kProxyServiceConfig;

/// TLS for the channel. PEM files; read when the Client is made.
struct TlsOptions {
  bool enabled = false;         ///< TLS instead of plaintext.
  std::string root_certs_file;  ///< CA certificate(s) to trust for the server; empty: system roots.
  std::string cert_file, key_file;  ///< This client's certificate chain and key, for mutual TLS.
  std::string
      server_name;  ///< Name to check in the server certificate instead of the target's host.
};

/// How to reach a server, or several replicas of one.
struct ClientOptions {
  /// Any gRPC target: "host:port", "dns:///name:port" (every address the name resolves to), or
  /// "ipv4:10.0.0.1:50051,10.0.0.2:50051" (a fixed list). With several addresses the default
  /// service config spreads calls over them.
  std::string target = "127.0.0.1:50051";
  /// Default per-call deadline; zero means none.
  std::chrono::milliseconds deadline{30000};
  int max_message_bytes = 64 << 20;  ///< Largest message sent or received.
  /// Extra integer channel arguments (gRPC channel arg names, e.g. "grpc.keepalive_time_ms").
  std::map<std::string, int> channel_args;
  /// gRPC service config (JSON): load balancing and retries. Empty: gRPC's defaults (pick_first,
  /// no retries).
  std::string service_config = kDefaultServiceConfig;
  TlsOptions tls;
  /// Memories and sessions live on the replica that made them, so the calls on one this Client
  /// made (Attend with it, TruncateSession, CloseSession, DeleteMemory) follow it there: each
  /// names the address its replica advertises (KvInfo::replica) in the `attnserve-replica`
  /// metadata key (deploy/nginx/nginx.conf routes by it), and with route_to_replica they go
  /// straight to that address over a channel of this client's own (TLS as above, no balancing,
  /// the service config's retries). Set false behind a proxy whose replicas this client cannot
  /// reach. Handles made by another Client go through `target` without a key;
  /// AttendStream calls are not routed (a stream reaches one replica: open it on a Client whose
  /// target is the session's replica).
  bool route_to_replica = true;
  /// Connections (HTTP/2) the client spreads its calls over, round robin: large tensors from many
  /// concurrent callers do not all queue on one connection, and the server reads them in
  /// parallel. A stream, and a memory's or session's calls, keep to one. At least 1.
  int connections = 4;
  /// The dtype queries, keys and values travel in. kModel (the default): float32 tensors go as the
  /// model computes (bfloat16 or float16, learnt once per model with GetModel) and answers come
  /// back in it, widened to float32 here: half the bytes each way, the same values (the server
  /// rounds to the model's dtype anyway). kAsGiven: as the caller made them.
  enum class WireDtype { kModel, kAsGiven };
  WireDtype wire_dtype = WireDtype::kModel;
};

/// Per-call settings.
struct CallOptions {
  /// Overrides ClientOptions::deadline when set; zero means none.
  std::optional<std::chrono::milliseconds> deadline;
  /// Sent as `authorization: Bearer <token>` when not empty: the server's --admin-token-file
  /// secret, for AdminService calls. Use it over TLS: on a plaintext channel anyone on the path
  /// can read it.
  std::string bearer_token;
  /// W3C Trace Context of the caller's span (docs/tracing.md): sent as `traceparent` (and
  /// `tracestate`) metadata when not empty, so the server's spans join the caller's trace. A
  /// failed call's CallStatus::trace_id then names the server's trace.
  std::string traceparent, tracestate;
  /// More metadata sent with the call, e.g. the tenant header a trusted gateway would set:
  /// {"attnserve-tenant", "team-a"} (docs/tenants.md).
  std::vector<std::pair<std::string, std::string>> metadata;
};

/// One AttendStream call: many requests on one stream, answered in completion order (match them
/// by request_id). Thread-safe: Send may be called from many threads.
class AttendStream {
 public:
  virtual ~AttendStream() = default;
  /// Queues `request` for sending; false once the stream has ended.
  virtual bool Send(const AttendRequest& request) = 0;
  /// Half-closes, waits for every answer, and returns the stream's own status.
  virtual CallStatus Finish() = 0;
};

/// A client of attnserve over one gRPC channel (to one server, or balanced over replicas).
/// Thread-safe: calls may be made from many threads at once; async callbacks run on gRPC's threads.
class Client {
 public:
  /// Creates the channel (connection is lazy). Throws std::invalid_argument naming the file when a
  /// TLS file cannot be read, or the option when the TLS options are incomplete.
  explicit Client(const ClientOptions& options = {});
  /// Waits for the callbacks of async calls still in flight.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// One attention forward; blocks.
  CallStatus Attend(const AttendRequest& request, AttendResult* result,
                    const CallOptions& call = {});
  /// One attention forward without blocking; `done` runs once, on the client's poller thread
  /// (keep it short: it delays the completion of the client's other calls).
  void AttendAsync(const AttendRequest& request, std::function<void(CallStatus, AttendResult)> done,
                   const CallOptions& call = {});
  /// Opens an AttendStream. `on_response` runs once per answer, on a gRPC thread, with that
  /// request's own status (a bad request does not end the stream). The stream's deadline, if
  /// any, covers the whole stream. Destroying the stream finishes it.
  std::unique_ptr<AttendStream> OpenStream(
      std::function<void(CallStatus, AttendResult)> on_response, const CallOptions& call = {});
  /// Every model the server holds.
  CallStatus ListModels(std::vector<ModelInfo>* models, const CallOptions& call = {});
  /// One model (its highest version); NOT_FOUND (5) when absent.
  CallStatus GetModel(const std::string& name, ModelInfo* model, const CallOptions& call = {});
  /// One version of a model (0 = the highest); NOT_FOUND (5) when absent.
  CallStatus GetModel(const std::string& name, int64_t version, ModelInfo* model,
                      const CallOptions& call = {});
  /// Asks the server to rescan its model repository (as SIGHUP does) and waits for the outcome.
  /// Needs admin credentials: CallOptions::bearer_token, or a client certificate the server names
  /// in --admin-client-names; else UNAUTHENTICATED (16) or PERMISSION_DENIED (7).
  CallStatus ReloadModels(ReloadResult* result, const CallOptions& call = {});
  /// Keys and values kept on the server (docs/kv.md "Keys and values kept on the server"). A memory
  /// or session lives on the replica that made it; its calls follow it there
  /// (ClientOptions::route_to_replica). A call that reaches another replica is refused with
  /// NOT_FOUND naming the replica that made it; one whose replica cannot be reached, UNAVAILABLE
  /// naming the replica (what it held is lost if it stopped).
  CallStatus CreateMemory(const MemoryRequest& request, KvInfo* memory,
                          const CallOptions& call = {});
  CallStatus DeleteMemory(const std::string& handle, const CallOptions& call = {});
  CallStatus OpenSession(const std::string& model, int64_t batch, KvInfo* session,
                         const CallOptions& call = {}, int64_t model_version = 0);
  CallStatus CloseSession(const std::string& handle, const CallOptions& call = {});
  /// A new session holding `handle`'s tokens (beam search, parallel sampling), sharing them on the
  /// server (nothing copied, counted once); close it like any session.
  CallStatus ForkSession(const std::string& handle, KvInfo* fork, const CallOptions& call = {});
  /// Takes a session back to its first `length` tokens; the next step appends after them
  /// (speculative decoding). Idempotent, so the retry policy may resend it. `session` (may be
  /// null) gets the session after it.
  CallStatus TruncateSession(const std::string& handle, int64_t length, KvInfo* session = nullptr,
                             const CallOptions& call = {});
  /// Shared memory (the server on this host runs with --allow-shared-memory; docs/clients.md
  /// "Shared memory"): registers [offset, offset + byte_size) of the POSIX shared memory object
  /// `key` (a SharedMemoryRegion's key()) under `name`, for tensors to name instead of carrying
  /// bytes. ALREADY_EXISTS (6) for a name registered already.
  CallStatus RegisterSharedMemory(const std::string& name, const std::string& key, uint64_t offset,
                                  uint64_t byte_size, const CallOptions& call = {});
  /// Unregisters `name` ("" = every region); requests using it finish with it.
  CallStatus UnregisterSharedMemory(const std::string& name, const CallOptions& call = {});
  /// The regions registered ("" = all).
  CallStatus SharedMemoryStatus(const std::string& name,
                                std::vector<SharedMemoryRegionInfo>* regions,
                                const CallOptions& call = {});
  /// gRPC health: `service` "" for the server, "attnserve.v1.AttentionService/<model>" for a model.
  CallStatus Health(const std::string& service, bool* serving, const CallOptions& call = {});

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace attnserve
