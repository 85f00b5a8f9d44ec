#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace attnserve {

/// The calls whose answer (a unary call's response and status, or a stream's next message) has been
/// handed to gRPC and not yet taken by the caller. One still not taken a while after it was handed
/// over is cancelled: a caller that never reads (a receive window left at zero) then holds neither
/// the answer's memory nor a stopping server for longer (docs/shutdown.md "The transport's
/// bounds"). The while: the timeout, plus the answer's bytes at kSlowestRate (a slow link's caller
/// that reads steadily gets its answer whole), at most the cap a stop sets. Thread-safe.
class SendWatch {
 public:
  SendWatch() = default;
  ~SendWatch();  ///< Stops watching; the calls still watched are left alone.
  SendWatch(const SendWatch&) = delete;
  SendWatch& operator=(const SendWatch&) = delete;

  /// The slowest a caller may read an answer, beyond the timeout.
  static constexpr int64_t kSlowestRate = 256 << 10;  // bytes a second
  /// How long a caller may take beyond its answer's bytes at kSlowestRate; zero: no bound (the
  /// default). Applies to answers handed over from now on and to those waiting.
  void SetTimeout(std::chrono::steady_clock::duration timeout);
  std::chrono::steady_clock::duration timeout() const;
  /// The most any caller may take, whatever its answer's size (a stop sets it); zero: none.
  void SetCap(std::chrono::steady_clock::duration cap);
  /// `ctx`'s call handed gRPC an answer of `bytes` now (again: the clock restarts).
  void Handed(grpc::ServerContextBase* ctx, int64_t bytes);
  /// gRPC sent it, or is done with the call: `ctx` is not cancelled by the watch from now on (a
  /// cancellation in progress is waited for). Call it before the call's context goes.
  void Taken(grpc::ServerContextBase* ctx);
  /// Calls the watch cancelled.
  int64_t cancelled() const { return cancelled_.load(); }

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::chrono::steady_clock::duration timeout_{}, cap_{};
  struct Handover {
    std::chrono::steady_clock::time_point at;
    int64_t bytes = 0;
  };
  std::unordered_map<grpc::ServerContextBase*, Handover> handed_;
  // Under mu_: when `h` is due.
  std::chrono::steady_clock::time_point Due(const Handover& h) const;
  bool stop_ = false;
  std::thread thread_;  // Started with the first timeout set.
  // Held while the watch cancels calls: Taken waits for it, so a context is never cancelled after
  // its call is done. Recursive: gRPC may end the call (and run Taken) inside TryCancel.
  std::recursive_mutex cancelling_;
  std::atomic<int64_t> cancelled_{0};
};

}  // namespace attnserve
