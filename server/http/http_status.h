#pragma once

#include "server/core/status.h"

namespace attnserve {

/// The one mapping from internal status to an HTTP status code (docs/api.md "Errors"), beside
/// ToGrpcCode, as Google's APIs map gRPC codes: INVALID_ARGUMENT and FAILED_PRECONDITION 400,
/// UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404, ABORTED and ALREADY_EXISTS 409,
/// RESOURCE_EXHAUSTED 429, CANCELLED 499, UNAVAILABLE 503 (retryable), DEADLINE_EXCEEDED 504,
/// anything else 500.
int ToHttpCode(StatusCode code);

}  // namespace attnserve
