#pragma once

#include "server/status.h"
#include "server/types.h"

namespace attnserve {

/// Checks `call` against the model and the per-request limits and, when it passes, fills its derived
/// fields (batched, batch, query_len, key_len). A pure function: no I/O, no allocation beyond messages.
/// Errors are INVALID_ARGUMENT naming the field, what arrived and what is allowed.
Status Validate(const ModelSpec& model, const AttendLimits& limits, AttendCall* call);

}  // namespace attnserve
