#pragma once

#include <grpcpp/grpcpp.h>

#include "server/request_pipeline.h"

namespace attnserve {

/// What the request pipeline needs of a gRPC call: its deadline on the steady clock (max when the
/// client set none), whether it is cancelled, and the attempt number that a client's retry policy
/// sends (gRFC A6's grpc-previous-rpc-attempts).
CallContext CallOf(grpc::CallbackServerContext* ctx);

/// The call's default reactor, finished at once with `status` (a unary call answered in place).
grpc::ServerUnaryReactor* Finished(grpc::CallbackServerContext* ctx, const Status& status);

}  // namespace attnserve
