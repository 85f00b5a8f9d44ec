#pragma once

#include "attnserve/v1/attention.pb.h"
#include "server/status.h"
#include "server/types.h"

namespace attnserve {

namespace pb = ::attnserve::v1;

/// Builds the engine's view of `request` without copying tensor bytes: the views point into
/// `request`, which must outlive `call`. Rejects unknown enum values (INVALID_ARGUMENT).
Status FromWire(const pb::AttendRequest& request, AttendCall* call);

/// Wire dtype of a domain dtype.
pb::DataType ToWire(DType dtype);

/// Fills a ModelInfo.
void ToWire(const ModelSpec& spec, pb::ModelInfo* info);

}  // namespace attnserve
