#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "server/core/status.h"
#include "server/core/wire.h"
#include "server/engine/host_staging.h"
#include "server/shm/shared_memory.h"

namespace attnserve {

/// The shared-memory side of one attnserve.v1 request: the regions its tensors were read from
/// (held until it is answered) and where its answer goes.
struct SharedTensors {
  std::vector<std::shared_ptr<const SharedRegion>> held;
  std::optional<RegionRef> output, weights;
  /// Whether the request names any region at all (nothing else to do when not).
  bool any() const { return !held.empty() || output || weights; }
};

/// Whether `request` names a shared-memory region anywhere (a tensor's `shared_memory`, or an
/// answer's region): cheap, for requests that do not.
bool NamesSharedMemory(const v1::AttendRequest& request);
bool NamesSharedMemory(const v1::CreateMemoryRequest& request);

/// Reads every tensor of `request` that names a region into its `data`, or, for the query, key
/// and value when `staging` is given (a CUDA server's), straight into pinned staging blocks
/// (`*staged`: one copy, which the device copies from). Notes where the answer goes and how large
/// it may be (`*limits`). Before a byte is read every window is checked: it fits its region and
/// holds exactly what its tensor's dtype and shape take (INVALID_ARGUMENT naming the field), and
/// all of them together are at most `max_input_bytes` (RESOURCE_EXHAUSTED: the front end passes
/// FlowLimits::max_region_input_bytes, --max-message-bytes). Also INVALID_ARGUMENT for a tensor
/// with both `data` and a region; NOT_FOUND for a region not registered; FAILED_PRECONDITION when
/// shared memory is off or a region was cut short.
Status ReadSharedTensors(const TenantRegions& shm, HostStaging* staging, v1::AttendRequest* request,
                         StagedInputs* staged, SharedTensors* out, OutputLimits* limits,
                         int64_t max_input_bytes = std::numeric_limits<int64_t>::max());
/// The same for CreateMemory's key, value and key_padding_mask (into their `data`).
Status ReadSharedTensors(const TenantRegions& shm, v1::CreateMemoryRequest* request,
                         SharedTensors* out,
                         int64_t max_input_bytes = std::numeric_limits<int64_t>::max());

/// Writes the answer's output and weights to the regions `shared` names, and drops their bytes
/// from `answer` (the response then carries their dtype and shape only). FAILED_PRECONDITION when
/// a region was cut short meanwhile.
Status WriteSharedTensors(const SharedTensors& shared, AttendAnswer* answer);

}  // namespace attnserve
