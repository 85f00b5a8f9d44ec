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
/// handed to gRPC and not yet taken by the caller. One still not taken a timeout after it was handed
/// over is cancelled: a caller that never reads (a receive window left at zero) then holds neither
/// the answer's memory nor a stopping server for longer (docs/shutdown.md "Limits"). Thread-safe.
class SendWatch {
 public:
  SendWatch() = default;
  ~SendWatch();  ///< Stops watching; the calls still watched are left alone.
  SendWatch(const SendWatch&) = delete;
  SendWatch& operator=(const SendWatch&) = delete;

  /// How long a caller may take; zero: no bound (the default). Applies to answers handed over from
  /// now on and to those waiting. During a stop the server lowers it.
  void SetTimeout(std::chrono::steady_clock::duration timeout);
  std::chrono::steady_clock::duration timeout() const;
  /// `ctx`'s call handed gRPC an answer now (again: the clock restarts).
  void Handed(grpc::ServerContextBase* ctx);
  /// gRPC sent it, or is done with the call: `ctx` is not cancelled by the watch from now on (a
  /// cancellation in progress is waited for). Call it before the call's context goes.
  void Taken(grpc::ServerContextBase* ctx);
  /// Calls the watch cancelled.
  int64_t cancelled() const { return cancelled_.load(); }

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::chrono::steady_clock::duration timeout_{};
  std::unordered_map<grpc::ServerContextBase*, std::chrono::steady_clock::time_point> handed_;
  bool stop_ = false;
  std::thread thread_;  // Started with the first timeout set.
  // Held while the watch cancels calls: Taken waits for it, so a context is never cancelled after
  // its call is done. Recursive: gRPC may end the call (and run Taken) inside TryCancel.
  std::recursive_mutex cancelling_;
  std::atomic<int64_t> cancelled_{0};
};

}  // namespace attnserve
