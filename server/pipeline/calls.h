#pragma once
// What a front end hands the request pipeline and gets back: the exchange it decodes into, the
// call the request came on, who calls the kept keys' and values' methods, and the handle that
// records a request's ending (docs/layout.md).

#include <functional>
#include <memory>
#include <string>

#include "attnserve/v1/attention.pb.h"
#include "server/core/deadline.h"
#include "server/core/status.h"
#include "server/core/wire.h"
#include "server/tenants/tenants.h"
#include "server/trace/tracer.h"

namespace attnserve {

/// Bounds on what requests in flight may hold (docs/shutdown.md "Limits").
struct FlowLimits {
  /// Request plus answer bytes of every request accepted whose answer its caller has not yet taken
  /// (a unary answer counts until gRPC is done with its call), over all calls; a request that would
  /// go past it gets RESOURCE_EXHAUSTED (server flag --max-inflight-bytes).
  int64_t max_inflight_bytes = int64_t{1} << 30;
  /// The same bound for one caller (Exchange::caller); 0: half of max_inflight_bytes (server flag
  /// --max-inflight-bytes-per-caller).
  int64_t max_inflight_bytes_per_caller = 0;
  int64_t InflightPerCaller() const {
    return max_inflight_bytes_per_caller > 0 ? max_inflight_bytes_per_caller
                                             : std::max<int64_t>(1, max_inflight_bytes / 2);
  }
  /// Requests one AttendStream may have accepted and not yet answered; at the limit the server
  /// stops reading that stream until the client takes answers (--max-stream-inflight).
  int max_stream_requests = 32;
  /// The same bound in request plus answer bytes (--max-stream-inflight-bytes); one request over it
  /// still runs, alone.
  int64_t max_stream_bytes = int64_t{64} << 20;
  /// Most bytes of one request's inputs read from shared-memory regions, checked before any is
  /// read: as much as one message may carry (--max-message-bytes).
  int64_t max_region_input_bytes = int64_t{64} << 20;
};

/// What the pipeline needs to know of the call a request came on, in no front end's terms.
struct CallContext {
  /// When the client stops waiting (steady clock; max: never).
  SteadyClock::time_point deadline = SteadyClock::time_point::max();
  /// True once the client has cancelled; polled while the request waits and after compute. Empty:
  /// never.
  std::function<bool()> cancelled;
  /// Earlier attempts of this call under the client's retry policy (reported in the answer).
  uint32_t previous_attempts = 0;
  /// The caller's W3C trace context (the call's `traceparent`/`tracestate` metadata).
  IncomingTrace trace;
  /// Who is calling (the front end's TenantOf: a verified certificate's name, a trusted header's
  /// value, or "default").
  std::string tenant = kDefaultTenant;
  /// Whether the call came from this host (loopback or a unix socket): only such a caller names
  /// shared-memory objects, which are on this host (docs/clients.md).
  bool local_peer = true;
  /// The peer's address without its port ("" when not known): what tells apart callers that name
  /// no tenant, for fair shares and per-caller bounds.
  std::string peer;
  /// The peer with its port, in gRPC's form ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:..."):
  /// what finds the uid of a loopback caller, whose shared-memory objects are its own.
  std::string peer_uri;

  bool IsCancelled() const { return cancelled && cancelled(); }
};

/// Who calls one of the kept keys' and values' methods, and the trace the call joins.
struct KvCaller {
  IncomingTrace trace;
  std::string tenant = kDefaultTenant;  ///< Only it may use what it made.
};

/// One AttendRequest on its way through the pipeline: the decoded request (the engine's views
/// point into it) and, once the pipeline reported success, its answer.
struct Exchange {
  virtual ~Exchange() = default;  // Front ends extend it with what their answers carry.
  v1::AttendRequest request;
  /// The request's tensors decoded straight into pinned staging (CUDA; empty otherwise): the
  /// engine reads them there; given back once the request is computed.
  StagedInputs staged;
  /// Where the answer must fit when the front end writes it to memory the caller gave (a
  /// shared-memory region); checked once the request is validated, before compute.
  OutputLimits output_limits;
  AttendAnswer answer;
  std::string model;  ///< Metrics label: the loaded model's name, or "" when none.
  /// Who asked (CallContext::tenant), its metrics label, and the priority level it was queued at.
  std::string tenant = kDefaultTenant, tenant_label = kDefaultTenant;
  /// Whose fair share and per-caller bounds it counts against (RequestPipeline::CallerOf).
  std::string caller = kDefaultTenant;
  int64_t level = 0;
  SteadyClock::time_point received = SteadyClock::now();
  int64_t held_bytes = 0;  ///< Counted against FlowLimits::max_inflight_bytes until recorded.
  /// Lets go of the request's tensor bytes once its answer is encoded (what its ending records, the
  /// ids, names and shapes, stays): an answer waiting for its caller holds only itself.
  void ReleaseInputs();
  /// Its trace (docs/tracing.md) and the times its spans take: decoded and admitted, computed (the
  /// batch's host times), answered (the pipeline told the front end).
  CallTrace trace;
  struct Times {
    SteadyClock::time_point admitted, started, finished, answered;
    TraceId batch_trace{};
    SpanId batch_span{};
    int batch_size = 0;
    int64_t tokens = 0;
    uint32_t attempts = 0;
  } times;
};

/// A call that stays open across requests (an AttendStream), which the drain must close.
class OpenCall {
 public:
  virtual ~OpenCall() = default;
  /// Runs under the pipeline's lock when the drain begins: take no more requests. True when that
  /// leaves the call with nothing to do; the pipeline then calls FinishNow, after its lock.
  virtual bool Drain() = 0;
  /// Ends the call that Drain found finished.
  virtual void FinishNow() = 0;
};

/// What a request whose answer its client can no longer receive is counted as, the call's
/// deadline being `deadline`: DEADLINE_EXCEEDED once it passed or is due within kDeadlineSkew (a
/// client's deadline reaches the server as a cancellation, possibly first), else CANCELLED.
Status UndeliveredBy(SteadyClock::time_point deadline);

class RequestPipeline;

/// A request's bytes still counted against FlowLimits::max_inflight_bytes after its ending was
/// recorded: its answer is on its way to a caller that has not taken it yet. Given back when the
/// token goes. Move-only.
class HeldBytes {
 public:
  HeldBytes() = default;
  HeldBytes(HeldBytes&& other) noexcept;
  HeldBytes& operator=(HeldBytes&& other) noexcept;
  HeldBytes(const HeldBytes&) = delete;
  HeldBytes& operator=(const HeldBytes&) = delete;
  ~HeldBytes();
  int64_t bytes() const { return bytes_; }

 private:
  friend class Answered;
  HeldBytes(RequestPipeline* pipeline, int64_t bytes, std::string caller)
      : pipeline_(pipeline), bytes_(bytes), caller_(std::move(caller)) {}
  RequestPipeline* pipeline_ = nullptr;
  int64_t bytes_ = 0;
  std::string caller_;
};

/// A request the pipeline has answered, on its way to the client: it owns the exchange and
/// records the request's ending exactly once (its count, latency, span and access-log line, and
/// the in-flight count and bytes a stop waits for). The front end reads the answer, sends it, and
/// calls Deliver with what the client was told; a handle let go of on any other path records the
/// request as not delivered (UndeliveredBy the call's deadline). So no path can leave a request
/// counted in flight. Move-only; one thread at a time.
class Answered {
 public:
  Answered() = default;
  Answered(Answered&& other) noexcept;
  Answered& operator=(Answered&& other) noexcept;
  Answered(const Answered&) = delete;
  Answered& operator=(const Answered&) = delete;
  ~Answered();

  /// The exchange, with its answer filled when status() is OK; null once delivered (or empty).
  Exchange* get() const { return exchange_.get(); }
  Exchange* operator->() const { return exchange_.get(); }
  /// What the pipeline tells the client: OK with the answer filled, or the failure (also
  /// DEADLINE_EXCEEDED or CANCELLED when the answer came too late to be delivered).
  const Status& status() const { return status_; }
  /// Records the request's ending as the client saw it (`seen`: status(), or what went wrong
  /// sending the answer) and frees the exchange. Later calls, and calls on an empty handle, do
  /// nothing.
  void Deliver(const Status& seen);
  /// As Deliver, but the request's bytes stay counted in flight until the returned token goes:
  /// what a front end does once it handed the answer to the transport, until the caller has it.
  HeldBytes Hand(const Status& seen);

 private:
  friend class RequestPipeline;
  Answered(RequestPipeline* pipeline, const char* method, std::unique_ptr<Exchange> x,
           Status status, SteadyClock::time_point deadline);

  RequestPipeline* pipeline_ = nullptr;
  const char* method_ = nullptr;
  std::unique_ptr<Exchange> exchange_;
  Status status_;
  SteadyClock::time_point deadline_ = SteadyClock::time_point::max();
};

}  // namespace attnserve
