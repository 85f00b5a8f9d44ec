#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

namespace attnserve {

/// Counts the calls one gRPC server holds, from the moment it takes a call until the call has ended
/// (its status sent), leaving out the long-lived ones: health watches (they stay open for as long
/// as their clients like) and reflection streams, which the shutdown cuts. With nothing counted,
/// what a stopping server still holds is idle connections, which the shutdown closes at once
/// instead of waiting for each client to read its GOAWAY (a grpcio client with no call open reads
/// it only at its 5 s backup poll).
///
/// Costs nothing per call: the counts are gRPC's own (channelz: calls started, succeeded and
/// failed per server, kept whatever we do), less the long-lived calls, which an interceptor marks;
/// its factory declines every other call, so no other call runs interceptor hooks. Thread-safe.
class CallCounter {
 public:
  /// The interceptor factory to give the gRPC server builder; it borrows this counter, which must
  /// outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Factory();

  /// Call once before building the server, then Attach once it is built.
  void BeforeBuild();
  /// Finds the server built since BeforeBuild (the first channelz server created after it). False
  /// when there is none (channelz off): open() then stays unknown.
  bool Attach();

  /// Calls held and not ended, long-lived ones left out; -1 when unknown (not attached).
  int64_t open() const;
  /// Waits until open() is 0 (true) or until `deadline` (false; also when unknown).
  bool WaitNone(std::chrono::steady_clock::time_point deadline) const;

 private:
  class Factory_;
  class Marker;

  intptr_t last_id_before_ = 0;  // The newest channelz server id before the build.
  intptr_t server_id_ = 0;       // Ours, once attached.
  std::atomic<int64_t> long_lived_{0};
};

}  // namespace attnserve
