#include "server/core/packing_plan.h"

#include <algorithm>

namespace attnserve {
namespace {

int GroupOf(const AttendCall& c) { return (c.self_attention() ? 0 : 2) + (c.is_causal ? 1 : 0); }

}  // namespace

bool VarlenEligible(const AttendCall& c, int64_t extra_keys) {
  return c.kv_use == AttendCall::Kv::kNone && c.weights == WeightsMode::kNone && !c.attn_mask &&
         !c.key_padding_mask && extra_keys == 0 && (c.batch_first() || c.batch == 1);
}

PackingPlan PlanPacking(const std::vector<const AttendCall*>& calls, bool varlen,
                        int64_t extra_keys) {
  PackingPlan plan;
  const size_t n = calls.size();
  std::vector<bool> eligible(n);
  for (size_t i = 0; i < n; ++i) eligible[i] = varlen && VarlenEligible(*calls[i], extra_keys);
  plan.order.resize(n);
  for (size_t i = 0; i < n; ++i) plan.order[i] = i;
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](size_t a, size_t b) {
    const int ga = GroupOf(*calls[a]), gb = GroupOf(*calls[b]);
    if (ga != gb) return ga < gb;
    return eligible[a] && !eligible[b];
  });
  plan.q_offset.assign(n, 0);
  plan.k_offset.assign(n, 0);
  for (size_t i : plan.order) {
    const AttendCall& c = *calls[i];
    plan.q_offset[i] = plan.q_rows;
    plan.q_rows += c.batch * c.query_len;
    if (c.self_attention()) plan.self_rows = plan.q_rows;
    if (c.key) {  // Keys on the wire (a memory's are kept projected, a session's come with the
                  // query).
      plan.k_offset[i] = plan.k_rows;
      plan.k_rows += c.batch * c.key_len;
    }
  }
  for (size_t first = 0; first < n;) {
    const int group = GroupOf(*calls[plan.order[first]]);
    size_t last = first;  // [first, last): the group's eligible calls
    while (last < n && GroupOf(*calls[plan.order[last]]) == group && eligible[plan.order[last]])
      ++last;
    if (last - first >= 2)
      plan.varlen_runs.emplace_back(plan.order.begin() + first, plan.order.begin() + last);
    size_t next = std::max(last, first + 1);  // On to the next group's start.
    while (next < n && GroupOf(*calls[plan.order[next]]) == group) ++next;
    first = next;
  }
  return plan;
}

}  // namespace attnserve
