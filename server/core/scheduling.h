#pragma once
// Priorities as Triton's dynamic batcher has them: levels (1 is served first), a default level for
// requests that name none, and a queue policy per level. No LibTorch, no gRPC, no clocks: the
// batcher applies them (docs/tenants.md).

#include <cstdint>
#include <map>
#include <string>

#include "server/core/status.h"

namespace attnserve {

/// What a request still queued past its level's timeout gets (Triton's timeout_action).
enum class TimeoutAction {
  kReject,  ///< Refused UNAVAILABLE, naming the level and its timeout.
  kDelay,   ///< Kept, behind every request of its level that has not timed out.
};

/// One level's queue (Triton's ModelQueuePolicy).
struct QueuePolicy {
  /// Requests of this level queued at most; beyond: RESOURCE_EXHAUSTED. 0: only --max-queue-size.
  int64_t max_queue_size = 0;
  /// How long a request of this level may wait to start; 0: as long as its deadline allows.
  int64_t default_timeout_us = 0;
  /// Whether a request's own timeout (attnserve.v1 queue_timeout_us, the OIP `timeout` parameter)
  /// replaces the default; only a shorter one does.
  bool allow_timeout_override = false;
  TimeoutAction timeout_action = TimeoutAction::kReject;
};

/// A model's (or the server's) priority levels. Levels 0: one level, a request's priority is
/// ignored (as Triton does without priority_levels).
struct PriorityOptions {
  int64_t levels = 0;
  /// The level of a request that gives priority 0; 0: the lowest (`levels`).
  int64_t default_level = 0;
  QueuePolicy default_policy;
  std::map<int64_t, QueuePolicy> level_policies;  ///< By level; others use default_policy.

  /// FAILED_PRECONDITION naming `where` and the field at fault.
  Status Validate(const std::string& where) const;
  /// The level a request's `priority` puts it in: 0 when there are no levels; priority 0 gives the
  /// default level; INVALID_ARGUMENT past the last level.
  StatusOr<int64_t> LevelOf(uint64_t priority) const;
  /// LevelOf(priority), but never more urgent than `best_level` (a tenant's best_priority_level;
  /// 0: no cap): a request asking for a more urgent level is queued at `best_level`, or at the
  /// lowest level when `best_level` is past it. Clamped, not refused: a client's priority is a
  /// hint, and clients that always send priority 1 must still be answered.
  StatusOr<int64_t> LevelOf(uint64_t priority, int64_t best_level) const;
  const QueuePolicy& PolicyOf(int64_t level) const;
  /// The time a request of `level` may wait to start, in µs (0: no limit): the level's default,
  /// or the request's own `requested_us` when the policy allows it and it is shorter.
  int64_t TimeoutUs(int64_t level, uint64_t requested_us) const;
};

/// Reads one --queue-policy flag: "LEVEL:key=value,..." or "default:key=value,...", keys
/// max_queue_size, default_timeout_microseconds, allow_timeout_override (true|false),
/// timeout_action (REJECT|DELAY), into `into`. FAILED_PRECONDITION naming what is wrong.
Status ParseQueuePolicyFlag(const std::string& spec, PriorityOptions* into);

/// "REJECT", "DELAY"; and the reverse (false for anything else).
const char* TimeoutActionName(TimeoutAction action);
bool ParseTimeoutAction(const std::string& name, TimeoutAction* action);

}  // namespace attnserve
