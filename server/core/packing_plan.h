#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "server/core/types.h"

namespace attnserve {

/// Where each call of a batch goes in the packed row matrices that the batch's projections and
/// attention run on (no padding rows). Calls are ordered in four groups, self-attention before
/// cross-attention and non-causal before causal, each group's varlen-eligible calls first, keeping
/// arrival order otherwise: so the self-attention rows come first (one packed in-projection), and
/// each group's eligible calls are one row range that one varlen attention launch can serve.
/// No LibTorch: tests/unit/core/packing_plan_test.cc checks it alone.
struct PackingPlan {
  std::vector<size_t> order;      ///< Call indices in row order.
  std::vector<int64_t> q_offset;  ///< By call index: its first row among the query rows.
  std::vector<int64_t>
      k_offset;           ///< By call index: its first row among the key/value rows on the wire.
  int64_t q_rows = 0;     ///< Query rows of all calls.
  int64_t self_rows = 0;  ///< The first self_rows query rows belong to self-attention calls.
  int64_t k_rows = 0;     ///< Key (and value) rows that arrived on the wire.
  /// Runs of at least two consecutive calls (call indices, in row order) of one group, all
  /// eligible: each one varlen attention launch.
  std::vector<std::vector<size_t>> varlen_runs;
};

/// Whether a validated call's attention can join a varlen launch: no weights, no masks, no kept
/// keys, no keys appended by the model (`extra_keys`), and each batch element's rows contiguous.
bool VarlenEligible(const AttendCall& call, int64_t extra_keys);

/// The plan for `calls` (validated). `varlen`: whether varlen launches are wanted at all.
PackingPlan PlanPacking(const std::vector<const AttendCall*>& calls, bool varlen,
                        int64_t extra_keys);

}  // namespace attnserve
