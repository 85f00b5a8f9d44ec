#pragma once

#include <grpcpp/support/status.h>

#include "server/core/status.h"

namespace attnserve {

/// The one mapping from internal status to gRPC status (docs/api.md "Errors"):
/// INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE (draining: retryable), RESOURCE_EXHAUSTED (queue full,
/// device memory), DEADLINE_EXCEEDED, CANCELLED; anything else is INTERNAL.
grpc::StatusCode ToGrpcCode(StatusCode code);

/// `status` as a grpc::Status with the same (already capped) message.
grpc::Status ToGrpcStatus(const Status& status);

}  // namespace attnserve
