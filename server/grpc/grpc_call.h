#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>

#include "server/core/caught.h"
#include "server/grpc/call_counter.h"
#include "server/pipeline/request_pipeline.h"
#include "server/protocol/caller.h"
#include "server/shm/shared_memory.h"

namespace attnserve {

/// What the request pipeline needs of a gRPC call: who calls (TenantOf), whether from this host,
/// its deadline on the steady clock (max when the client set none), whether it is cancelled, and
/// the attempt number that a client's retry policy sends (gRFC A6's grpc-previous-rpc-attempts).
/// Every handler that acts for a tenant starts here: a call whose tenant header is invalid is
/// refused before anything else (TenantOf's INVALID_ARGUMENT).
StatusOr<CallContext> CallOf(grpc::CallbackServerContext* ctx, const RequestPipeline& pipeline);
/// Who is calling (docs/tenants.md): the verified client certificate's name under mutual TLS (its
/// common name, else its first subject alternative name); else, only when the server was told to
/// trust one (`tenant_header`, --tenant-header), that metadata key's value; else "default". A
/// header the server does not trust is ignored; a trusted header that is present but does not name
/// a tenant (two values, empty, over 128 characters, a space or a control character) is
/// INVALID_ARGUMENT naming the key, never "default".
StatusOr<std::string> TenantOf(const grpc::ServerContextBase* ctx,
                               const std::string& tenant_header);
/// The call's peer as the connection guard names it (core/peer.h's PeerOf): "127.0.0.1", an IPv6
/// address's /64 ("2001:db8::/64"), "unix".
std::string PeerAddressOf(const grpc::ServerContextBase* ctx);
/// Whether the call's peer is on this host: a unix socket, or loopback (127.0.0.0/8, ::1, or
/// loopback mapped into IPv6).
bool IsLocalPeer(const grpc::ServerContextBase* ctx);
/// The trace and tenant of a call to one of the kept keys' and values' methods.
inline KvCaller KvCallerOf(const CallContext& call) { return KvCaller{call.trace, call.tenant}; }
/// The caller's W3C trace context: the call's `traceparent` and `tracestate` metadata (malformed:
/// none; several `tracestate` values are one list, joined with commas).
IncomingTrace TraceOf(const grpc::ServerContextBase* ctx);
/// A failed call traced by the server names its trace in the `attnserve-trace-id` trailing
/// metadata (before the call finishes), so its client can find it.
void TellTraceOfFailure(grpc::ServerContextBase* ctx, const CallTrace& trace, const Status& seen);

/// A unary call's reactor, counted in `calls` from its making until gRPC is done with the call (so
/// a stop waits for its answer to go out), its answer watched by the send timeout (calls.sends())
/// from Answer until then. Deletes itself then. Every unary handler answers through one.
class CountedUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  CountedUnaryReactor(CallCounter& calls, grpc::CallbackServerContext* ctx);
  /// Finishes the call with `status` (the response written before): `held`, the request's bytes,
  /// stay counted in flight until gRPC is done with the call (the caller has the answer).
  void Answer(const grpc::Status& status, HeldBytes held = {});
  void OnDone() override;
  // Its reactions are trivial (a count, a delete), so gRPC may run OnDone on the thread that ends
  // the call, as it does for the context's default reactor; otherwise each call's end would hop to
  // gRPC's executor (a thread switch per call, which ThreadSanitizer, not seeing into Debian's
  // gRPC, reported as a race on the answer's buffer).
  bool InternalInlineable() override { return true; }

 private:
  CallCounter& calls_;
  grpc::CallbackServerContext* ctx_;
  HeldBytes held_;
};
CountedUnaryReactor* NewUnaryReactor(CallCounter& calls, grpc::CallbackServerContext* ctx);

/// A unary call whose request message never arrived (the handler's ByteBuffer is not valid): the
/// client half-closed without one (INVALID_ARGUMENT saying `method` takes exactly one `message`),
/// cancelled before sending it (CANCELLED) or its deadline passed first (DEADLINE_EXCEEDED). None
/// is a request for a model; which of these it was is only certain once the call is done, so the
/// outcome is recorded (as `method`, model "") then.
grpc::ServerUnaryReactor* NoMessage(RequestPipeline& pipeline, CallCounter& calls,
                                    grpc::CallbackServerContext* ctx, const char* method,
                                    const char* message);

/// A unary call's decoded request through the pipeline to the call's end: `answer` (once, on any
/// thread) writes the response from the answered exchange and returns what the client is told;
/// then a failure names its trace, the handle records the ending, and `reactor` finishes the call.
void AttendUnary(RequestPipeline& pipeline, const char* method, grpc::CallbackServerContext* ctx,
                 CallContext call, CountedUnaryReactor* reactor, std::unique_ptr<Exchange> x,
                 std::function<Status(Answered&)> answer);

/// A unary call answered in place: its reactor, finished at once with `status` (a failure names
/// `trace`, when the server traced the call).
grpc::ServerUnaryReactor* Finished(CallCounter& calls, grpc::CallbackServerContext* ctx,
                                   const Status& status, const CallTrace& trace = {});

/// A unary call for its caller answered in place: `fn(const CallContext&, CallTrace*)` returns
/// what the client is told, a throw included (Caught, naming `method`); a caller that cannot be
/// named (CallOf's refusal) is told that instead, and `fn` never runs.
template <typename Fn>
grpc::ServerUnaryReactor* AnsweredFor(RequestPipeline& pipeline, CallCounter& calls,
                                      grpc::CallbackServerContext* ctx, const char* method,
                                      Fn&& fn) {
  const StatusOr<CallContext> call = CallOf(ctx, pipeline);
  CallTrace traced;
  const Status status =
      call.ok() ? Caught(method, [&] { return fn(*call, &traced); }) : call.status();
  return Finished(calls, ctx, status, traced);
}

}  // namespace attnserve
