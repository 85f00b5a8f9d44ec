#pragma once

#include "server/grpc/health.h"
#include "server/kv/kv_store.h"
#include "server/models/model_repository.h"
#include "server/pipeline/metrics.h"

namespace attnserve {

/// What a reload tells the rest of the server, on the reloading thread: the metrics' model info and
/// reload counters, health's statuses, and the end of every memory and session of a version that
/// left (replaced or removed). Everything passed must outlive the repository's reloads.
ModelRepositoryHooks ReloadHooks(ServerMetrics& metrics, KvStore& kv, HealthReporter& health);

}  // namespace attnserve
