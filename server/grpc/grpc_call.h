#pragma once

#include <grpcpp/grpcpp.h>

#include "server/grpc/call_counter.h"
#include "server/pipeline/request_pipeline.h"

namespace attnserve {

/// What the request pipeline needs of a gRPC call: its deadline on the steady clock (max when the
/// client set none), whether it is cancelled, and the attempt number that a client's retry policy
/// sends (gRFC A6's grpc-previous-rpc-attempts).
CallContext CallOf(grpc::CallbackServerContext* ctx);

/// A unary call's reactor, counted in `calls` from its making until gRPC is done with the call (so
/// a stop waits for its answer to go out). Deletes itself then. Every unary handler answers
/// through one.
grpc::ServerUnaryReactor* NewUnaryReactor(CallCounter& calls, grpc::CallbackServerContext* ctx);

/// A unary call answered in place: its reactor, finished at once with `status`.
grpc::ServerUnaryReactor* Finished(CallCounter& calls, grpc::CallbackServerContext* ctx,
                                   const Status& status);

}  // namespace attnserve
