#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "server/grpc/send_watch.h"

namespace attnserve {

/// Counts the calls attnserve has taken and not yet finished: from the moment one of its handlers
/// takes a call (or gRPC's health service a Check) until gRPC is done with it (its status sent, or
/// the call cancelled). This is what a stop must wait for, and what it cuts when the grace period
/// ends. Calls that never reach a handler are not counted: a request whose deadline passed or that
/// its client reset while it was still arriving, a message over the size limit; nothing of theirs
/// is held (gRPC's own per-server counts, channelz, keep such calls as started for ever). Nor are
/// the long-lived calls that the stop ends itself: health watches and reflection streams.
///
/// Once the stop begins to cut (BeginCut), a call that ends cancelled was cut by it; cut() counts
/// those and the calls still open, which an exit then would cut. Thread-safe.
class CallCounter {
 public:
  /// A call was taken; End must follow exactly once.
  void Begin();
  /// The call is done; `cancelled`: it ended without its status reaching the client (gRPC's
  /// IsCancelled: cancelled by its client or by the stop, or broken), not by a status we chose.
  void End(bool cancelled);

  /// Calls taken and not ended.
  int64_t open() const;
  /// Waits until open() is 0 and no call began for `quiet` (true), or until `deadline` (false).
  /// The quiet period lets calls a stopping gRPC received just before it stopped reach their
  /// handlers instead of being cancelled with the idle connections.
  bool WaitNone(std::chrono::steady_clock::time_point deadline,
                std::chrono::steady_clock::duration quiet = {}) const;

  /// The stop cuts what is open from now on: calls that end cancelled after this count as cut.
  void BeginCut();
  /// Calls the stop cut: those ended cancelled since BeginCut plus those still open (an exit now
  /// cuts them too). Before BeginCut, the calls an exit now would cut: those open.
  int64_t cut() const;

  /// An interceptor factory for the gRPC server builder that counts gRPC's own health Check calls
  /// (answered at once, but a stop should not cut one mid-answer); it declines every other call, so
  /// no other call runs interceptor hooks. Borrows this counter, which must outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> HealthChecks();

  /// The calls whose answers wait for their callers (the send timeout).
  SendWatch& sends() { return sends_; }

 private:
  class Marker;
  class Factory;

  mutable std::mutex mu_;
  mutable std::condition_variable none_;
  int64_t open_ = 0;
  std::chrono::steady_clock::time_point last_begin_;
  bool cutting_ = false;
  int64_t cut_ended_ = 0;  // Ended cancelled since BeginCut.
  SendWatch sends_;
};

}  // namespace attnserve
