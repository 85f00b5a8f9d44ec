#pragma once

#include "server/core/status.h"
#include "server/core/types.h"

namespace attnserve {

/// Checks `call` against the model and the per-request limits and, when it passes, fills its
/// derived fields (batched, batch, query_len, key_len). A pure function: no I/O, no allocation
/// beyond messages. Errors are INVALID_ARGUMENT naming the field, what arrived and what is allowed.
Status Validate(const ModelSpec& model, const AttendLimits& limits, AttendCall* call);

/// The same for CreateMemory's key, value and key_padding_mask (in `call`, with its layout): fills
/// batched, batch and key_len, sets kv_use = kCreateMemory and query = key (no query rows; the
/// batcher groups requests by this dtype).
Status ValidateCreateMemory(const ModelSpec& model, const AttendLimits& limits, AttendCall* call);

}  // namespace attnserve
