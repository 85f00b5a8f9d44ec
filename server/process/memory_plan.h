#pragma once

#include <cstdint>
#include <string>

namespace attnserve {

/// Which memory budgets were given as flags. Those not given follow the container's memory limit:
/// each is lowered from its default so that the process fits under it (PlanMemory, README
/// "Memory"). Without a limit, or when all are given, nothing changes.
struct MemoryFlagsGiven {
  bool kv_budget = false;     ///< --kv-budget-bytes
  bool kv_max_entry = false;  ///< --kv-max-entry-bytes
  bool inflight = false;      ///< --max-inflight-bytes
  bool message = false;       ///< --max-message-bytes
  bool staging = false;       ///< --staging-bytes
};

/// The memory budgets the server runs with, as configured (flags or their defaults) and which were
/// given explicitly.
struct MemoryBudgets {
  int64_t kv_budget_bytes = 0;     ///< --kv-budget-bytes
  int64_t kv_max_entry_bytes = 0;  ///< --kv-max-entry-bytes
  int64_t max_inflight_bytes = 0;  ///< --max-inflight-bytes
  int64_t max_message_bytes = 0;   ///< --max-message-bytes
  MemoryFlagsGiven given;
  int64_t staging_bytes = 0;  ///< --staging-bytes (CUDA; 0 on the CPU, which stages nothing)
};

/// What the plan starts from: the container's limit (0: none), the process's resident size once
/// its models are loaded, and the compute threads.
struct MemoryPlanInput {
  int64_t limit_bytes = 0;
  std::string limit_source;  ///< The file the limit came from, for the start-up line.
  int64_t idle_bytes = 0;
  int workers = 1;
  MemoryBudgets budgets;
};

/// The budgets to run with and what they let the process reach.
struct MemoryPlan {
  MemoryBudgets budgets;
  int64_t peak_bytes = 0;   ///< The most the process may hold with them (EstimatePeak).
  std::string description;  ///< For the start-up line: the limit and the budgets it sized.
  std::string warning;      ///< Non-empty when budgets given as flags may not fit the limit.
};

/// The memory model (docs/shutdown.md "Memory"), measured on the demo model's largest requests: the
/// process holds its idle size, plus per compute thread its attention blocks, plus the kept keys
/// and values (the K/V budget), plus for requests in flight about kWorkingSetPerInflightByte times
/// the bytes they hold (wire buffer, decoded copy, projections, answer), plus messages on the move
/// (kArrivingMessages of the largest size at once, each held three times: its wire bytes and
/// decoded copy until the budget admits or refuses it, an answer's bytes still leaving after its
/// call was counted out), plus on CUDA the pinned staging. A single request larger than the
/// in-flight budget still runs alone, so the in-flight term is at least the largest request's
/// bytes.
inline constexpr int64_t kIdleGrowthBytes = int64_t{64} << 20;  ///< Warm-up, threads, heap slack.
inline constexpr int64_t kPerWorkerBytes = int64_t{32} << 20;   ///< Attention blocks, stack.
inline constexpr int64_t kWorkingSetPerInflightByte = 6;
inline constexpr int64_t kArrivingMessages = 8;
inline constexpr int64_t kCopiesPerArrivingMessage = 3;
/// The share of the limit kept free: allocator slack and everything the model leaves out.
inline constexpr double kMarginFraction = 0.10;

/// The most the process may hold with `budgets` (see the constants above).
int64_t EstimatePeak(int64_t idle_bytes, int workers, const MemoryBudgets& budgets);

/// Sizes the budgets not given as flags so that EstimatePeak stays under the limit less the margin:
/// each is lowered, never raised, from its default (40% of what the limit leaves after the idle
/// size for kept keys and values, the rest for requests in flight and messages arriving; one
/// message at most a quarter of the in-flight budget, so that a request and its answer fit it even
/// at float32 width from a 16-bit wire; the pinned staging at most 10% of what the limit leaves).
/// Budgets given as flags are kept, with a warning naming the numbers when they may not fit.
/// Without a limit nothing changes.
MemoryPlan PlanMemory(const MemoryPlanInput& in);

}  // namespace attnserve
