#include "server/grpc/grpc_call.h"

#include <cstdlib>
#include <string>

#include "server/core/deadline.h"
#include "server/core/peer.h"
#include "server/grpc/grpc_status.h"
#include "server/protocol/caller.h"

namespace attnserve {

namespace {

// The call's deadline on the steady clock (max when the client set none).
SteadyClock::time_point SteadyDeadlineOf(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return SteadyClock::time_point::max();
  }
  return SteadyClock::now() + (deadline - std::chrono::system_clock::now());
}

}  // namespace

StatusOr<CallContext> CallOf(grpc::CallbackServerContext* ctx, const RequestPipeline& pipeline) {
  CallContext call;
  if (!pipeline.Published()) return Status(StatusCode::kUnavailable, "the server is starting");
  ASSIGN_OR_RETURN(call.tenant, TenantOf(ctx, pipeline.tenant_header()));
  call.local_peer = IsLocalPeer(ctx);
  call.peer = PeerAddressOf(ctx);
  call.peer_uri = ctx->peer();
  call.deadline = SteadyDeadlineOf(ctx);
  call.cancelled = [ctx] { return ctx->IsCancelled(); };
  call.trace = TraceOf(ctx);
  const auto& metadata = ctx->client_metadata();
  if (auto it = metadata.find("grpc-previous-rpc-attempts"); it != metadata.end()) {
    const std::string text(it->second.data(), it->second.size());
    call.previous_attempts = static_cast<uint32_t>(std::strtoul(text.c_str(), nullptr, 10));
  }
  return call;
}

StatusOr<std::string> TenantOf(const grpc::ServerContextBase* ctx,
                               const std::string& tenant_header) {
  std::vector<std::string> certificate_names;
  const std::shared_ptr<const grpc::AuthContext> peer = ctx->auth_context();
  if (peer && peer->IsPeerAuthenticated()) {
    for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
      for (const grpc::string_ref& value : peer->FindPropertyValues(property))
        certificate_names.emplace_back(value.begin(), value.end());
    }
  }
  std::vector<std::string> values;
  if (!tenant_header.empty()) {
    for (auto [it, end] = ctx->client_metadata().equal_range(tenant_header); it != end; ++it)
      values.emplace_back(it->second.begin(), it->second.end());
  }
  return TenantOfCall(certificate_names, tenant_header, values, "metadata '" + tenant_header + "'");
}

std::string PeerAddressOf(const grpc::ServerContextBase* ctx) { return PeerOfUri(ctx->peer()); }

bool IsLocalPeer(const grpc::ServerContextBase* ctx) {
  std::string peer = ctx->peer();
  // gRPC writes an IPv6 peer as a URI: "ipv6:%5B::1%5D:port".
  for (const auto& [escaped, bracket] : {std::pair{"%5B", "["}, std::pair{"%5D", "]"}}) {
    for (size_t at; (at = peer.find(escaped)) != std::string::npos;) peer.replace(at, 3, bracket);
  }
  const auto starts = [&peer](const char* prefix) { return peer.rfind(prefix, 0) == 0; };
  return starts("unix:") || starts("unix-abstract:") || starts("ipv4:127.") ||
         starts("ipv6:[::1]:") || starts("ipv6:[::ffff:127.");
}

IncomingTrace TraceOf(const grpc::ServerContextBase* ctx) {
  const auto& metadata = ctx->client_metadata();
  const auto parent = metadata.equal_range("traceparent");
  if (parent.first == parent.second || std::next(parent.first) != parent.second) return {};
  std::string state;
  for (auto [it, end] = metadata.equal_range("tracestate"); it != end; ++it) {
    if (!state.empty()) state += ',';
    state.append(it->second.data(), it->second.size());
  }
  const grpc::string_ref p = parent.first->second;
  return ReadIncoming(std::string_view(p.data(), p.size()), state);
}

void TellTraceOfFailure(grpc::ServerContextBase* ctx, const CallTrace& trace, const Status& seen) {
  if (!seen.ok() && trace.on) ctx->AddTrailingMetadata("attnserve-trace-id", Hex(trace.trace_id));
}

namespace {

class NoMessageReactor final : public grpc::ServerUnaryReactor {
 public:
  NoMessageReactor(RequestPipeline& pipeline, CallCounter& calls, grpc::CallbackServerContext* ctx,
                   const char* method, const char* message)
      : pipeline_(pipeline),
        calls_(calls),
        ctx_(ctx),
        method_(method),
        refusal_(InvalidArgument(std::string("request: no request message arrived (the client "
                                             "half-closed without one); ") +
                                 method + " takes exactly one " + message)) {
    calls_.Begin();
    calls_.sends().Handed(ctx_, 0);
    Finish(ToGrpcStatus(refusal_));
  }
  void OnDone() override {
    calls_.sends().Taken(ctx_);
    calls_.End(ctx_->IsCancelled());
    pipeline_.RecordUndecoded(method_, Outcome());
    delete this;
  }

 private:
  // gRPC marks a call whose deadline passed as cancelled too, and a client's deadline arrives as
  // a cancellation: the deadline first, as the client saw it.
  Status Outcome() const {
    if (!ctx_->IsCancelled()) return refusal_;
    if (CancelledByDeadline(SteadyDeadlineOf(ctx_), SteadyClock::now())) {
      return Status(StatusCode::kDeadlineExceeded, "deadline passed before its request arrived");
    }
    return Status(StatusCode::kCancelled, "cancelled before its request arrived");
  }

  RequestPipeline& pipeline_;
  CallCounter& calls_;
  grpc::CallbackServerContext* ctx_;
  const char* method_;
  const Status refusal_;
};

}  // namespace

CountedUnaryReactor::CountedUnaryReactor(CallCounter& calls, grpc::CallbackServerContext* ctx)
    : calls_(calls), ctx_(ctx) {
  calls_.Begin();
}

void CountedUnaryReactor::Answer(const grpc::Status& status, HeldBytes held) {
  const int64_t bytes = held.bytes();
  held_ = std::move(held);
  // After held_ is set: the watch's lock, taken again by OnDone's Taken, orders the write before
  // OnDone's read where ThreadSanitizer can see it (gRPC orders Finish and OnDone itself, inside
  // its uninstrumented library).
  calls_.sends().Handed(ctx_, bytes);
  Finish(status);
}

void CountedUnaryReactor::OnDone() {
  calls_.sends().Taken(ctx_);
  calls_.End(ctx_->IsCancelled());
  delete this;  // Its held bytes go back with it.
}

grpc::ServerUnaryReactor* NoMessage(RequestPipeline& pipeline, CallCounter& calls,
                                    grpc::CallbackServerContext* ctx, const char* method,
                                    const char* message) {
  return new NoMessageReactor(pipeline, calls, ctx, method, message);
}

void AttendUnary(RequestPipeline& pipeline, const char* method, grpc::CallbackServerContext* ctx,
                 CallContext call, CountedUnaryReactor* reactor, std::unique_ptr<Exchange> x,
                 std::function<Status(Answered&)> answer) {
  pipeline.Attend(method, std::move(x), std::move(call),
                  [ctx, reactor, answer = std::move(answer)](Answered answered) {
                    const Status seen = answer(answered);
                    TellTraceOfFailure(ctx, answered->trace, seen);
                    // Its bytes stay in the in-flight budget until the caller has the answer.
                    HeldBytes held = answered.Hand(seen);
                    reactor->Answer(ToGrpcStatus(seen), std::move(held));
                  });
}

CountedUnaryReactor* NewUnaryReactor(CallCounter& calls, grpc::CallbackServerContext* ctx) {
  return new CountedUnaryReactor(calls, ctx);
}

grpc::ServerUnaryReactor* Finished(CallCounter& calls, grpc::CallbackServerContext* ctx,
                                   const Status& status, const CallTrace& trace) {
  CountedUnaryReactor* reactor = NewUnaryReactor(calls, ctx);
  TellTraceOfFailure(ctx, trace, status);
  reactor->Answer(ToGrpcStatus(status));
  return reactor;
}

}  // namespace attnserve
