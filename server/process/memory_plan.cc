#include "server/process/memory_plan.h"

#include <algorithm>
#include <vector>

namespace attnserve {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::string Mib(int64_t bytes) { return std::to_string(bytes / kMiB) + " MiB"; }

int64_t FloorMib(double bytes) { return static_cast<int64_t>(bytes / kMiB) * kMiB; }

// The bytes one request may hold in flight: its message and its answer, each at float32 width
// from a 16-bit wire (twice their wire size).
int64_t LargestRequestBytes(int64_t max_message_bytes) { return 4 * max_message_bytes; }

}  // namespace

int64_t EstimatePeak(int64_t idle_bytes, int workers, const MemoryBudgets& b) {
  const int64_t in_flight =
      std::max(b.max_inflight_bytes, LargestRequestBytes(b.max_message_bytes));
  return idle_bytes + kIdleGrowthBytes + workers * kPerWorkerBytes + b.kv_budget_bytes +
         b.staging_bytes + kWorkingSetPerInflightByte * in_flight +
         kCopiesPerArrivingMessage * kArrivingMessages * b.max_message_bytes;
}

MemoryPlan PlanMemory(const MemoryPlanInput& in) {
  MemoryPlan plan;
  MemoryBudgets& b = plan.budgets;
  b = in.budgets;
  if (in.limit_bytes <= 0) {
    plan.peak_bytes = EstimatePeak(in.idle_bytes, in.workers, b);
    return plan;
  }
  const double usable = static_cast<double>(in.limit_bytes) * (1 - kMarginFraction);
  const double fixed =
      static_cast<double>(in.idle_bytes + kIdleGrowthBytes + in.workers * kPerWorkerBytes);
  double left = std::max(0.0, usable - fixed);
  // Each budget not given is the smaller of its default and its share, and at least the least its
  // flag takes (1 MiB).
  const auto size = [](int64_t fallback, double share) {
    return std::max(kMiB, std::min(fallback, FloorMib(share)));
  };
  if (!b.given.staging && b.staging_bytes > 0) b.staging_bytes = size(b.staging_bytes, 0.1 * left);
  left = std::max(0.0, left - static_cast<double>(b.staging_bytes));
  if (!b.given.kv_budget) b.kv_budget_bytes = size(b.kv_budget_bytes, 0.4 * left);
  if (b.given.kv_max_entry) {
    b.kv_budget_bytes = std::max(b.kv_budget_bytes, b.kv_max_entry_bytes);
  } else {
    b.kv_max_entry_bytes = std::min(b.kv_max_entry_bytes, b.kv_budget_bytes);
  }
  // What requests in flight and messages on the move may take: 6 F + 24 M, with M <= F / 4.
  const double rest = std::max(0.0, left - static_cast<double>(b.kv_budget_bytes));
  const double k = static_cast<double>(kWorkingSetPerInflightByte);
  const double arriving = static_cast<double>(kCopiesPerArrivingMessage * kArrivingMessages);
  if (!b.given.inflight && !b.given.message) {
    b.max_inflight_bytes = size(b.max_inflight_bytes, rest / (k + arriving / 4));
    b.max_message_bytes = size(b.max_message_bytes, b.max_inflight_bytes / 4.0);
  } else if (!b.given.inflight) {
    b.max_inflight_bytes = size(b.max_inflight_bytes,
                                (rest - arriving * static_cast<double>(b.max_message_bytes)) / k);
  } else if (!b.given.message) {
    const double by_rest = (rest - k * static_cast<double>(b.max_inflight_bytes)) / arriving;
    b.max_message_bytes = size(b.max_message_bytes, std::min(b.max_inflight_bytes / 4.0, by_rest));
  }
  plan.peak_bytes = EstimatePeak(in.idle_bytes, in.workers, b);

  std::vector<std::string> sized;
  const auto note = [&](bool given, const char* flag, int64_t value, int64_t before) {
    if (!given && value != before) sized.push_back(std::string(flag) + " " + Mib(value));
  };
  note(b.given.kv_budget, "--kv-budget-bytes", b.kv_budget_bytes, in.budgets.kv_budget_bytes);
  note(b.given.kv_max_entry, "--kv-max-entry-bytes", b.kv_max_entry_bytes,
       in.budgets.kv_max_entry_bytes);
  note(b.given.inflight, "--max-inflight-bytes", b.max_inflight_bytes,
       in.budgets.max_inflight_bytes);
  note(b.given.message, "--max-message-bytes", b.max_message_bytes, in.budgets.max_message_bytes);
  note(b.given.staging, "--staging-bytes", b.staging_bytes, in.budgets.staging_bytes);
  plan.description = "memory limit " + Mib(in.limit_bytes) + " (" + in.limit_source + ")";
  if (!sized.empty()) {
    plan.description += ": ";
    for (size_t i = 0; i < sized.size(); ++i) plan.description += (i ? ", " : "") + sized[i];
  }
  plan.description += "; peak at most ~" + Mib(plan.peak_bytes);
  if (static_cast<double>(plan.peak_bytes) > usable) {
    plan.warning =
        "attnserve: warning: the memory limit " + Mib(in.limit_bytes) + " (" + in.limit_source +
        ") is too small for these budgets: idle " + Mib(in.idle_bytes) + ", --kv-budget-bytes " +
        Mib(b.kv_budget_bytes) + ", --max-inflight-bytes " + Mib(b.max_inflight_bytes) +
        (b.staging_bytes > 0 ? ", --staging-bytes " + Mib(b.staging_bytes) : std::string()) +
        ", --max-message-bytes " + Mib(b.max_message_bytes) + " may reach ~" +
        Mib(plan.peak_bytes) + ", over the " + Mib(static_cast<int64_t>(usable)) +
        " attnserve keeps under the limit (docs/shutdown.md \"Memory\"); the kernel may kill the "
        "process when they fill. Lower them, or leave them unset to size them from the "
        "limit";
  }
  return plan;
}

}  // namespace attnserve
