#pragma once
// A call's time: the steady clock every queue and deadline is on, and the rule that tells a
// deadline from a client's cancellation. No gRPC: the front ends and the batcher share it.

#include <chrono>

namespace attnserve {

using SteadyClock = std::chrono::steady_clock;

/// How much later than the client's the server's copy of a call's deadline may fall: the server
/// counts it from the call's arrival, the client from its sending. A client whose deadline passes
/// cancels the call (HTTP/2 has no code for a deadline), and that can reach the server first.
inline constexpr std::chrono::milliseconds kDeadlineSkew{100};

/// Whether a cancelled call was ended by its deadline (due within kDeadlineSkew of `now`) rather
/// than by its client: it is then counted as DEADLINE_EXCEEDED, as the client saw it.
inline bool CancelledByDeadline(SteadyClock::time_point deadline, SteadyClock::time_point now) {
  return deadline - now <= kDeadlineSkew;
}

/// Whether a call's deadline ended it by `now`: it passed, or the call is `cancelled` and it is due
/// within kDeadlineSkew (gRPC also marks a call whose deadline passed as cancelled).
inline bool DeadlineEnded(SteadyClock::time_point deadline, SteadyClock::time_point now,
                          bool cancelled) {
  return cancelled ? CancelledByDeadline(deadline, now) : now >= deadline;
}

}  // namespace attnserve
