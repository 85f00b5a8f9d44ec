#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace attnserve {

/// Counts the calls gRPC has handed to this server's methods and not yet finished: from the moment
/// a call is matched to its method (before its handler runs) until gRPC has sent its status and let
/// it go. Health watches and reflection streams are not counted: they stay open for as long as
/// their clients like, and the shutdown cuts them. With nothing counted, what a stopping server
/// still holds is idle connections, which the shutdown closes at once instead of waiting for each
/// client to read its GOAWAY (a grpcio client with no call open reads it only at its 5 s backup
/// poll). Thread-safe.
class CallCounter {
 public:
  /// The interceptor factory to give the gRPC server builder; it borrows this counter, which must
  /// outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Factory();

  /// Calls counted and not finished.
  int64_t open() const;
  /// Waits until no counted call is open (true) or until `deadline` (false).
  bool WaitNone(std::chrono::steady_clock::time_point deadline) const;

 private:
  class Factory_;
  class Marker;
  void Add();
  void Remove();

  mutable std::mutex mu_;
  mutable std::condition_variable none_cv_;
  std::atomic<int64_t> open_{0};
};

}  // namespace attnserve
