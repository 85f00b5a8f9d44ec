#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "server/engine/attention_model.h"
#include "server/status.h"
#include "server/types.h"

namespace attnserve {

using SteadyClock = std::chrono::steady_clock;

/// One accepted request on its way to the engine. Owns nothing on the wire: `call` and `outputs`
/// point into the RPC's request and response, which live until `done` has run.
struct WorkItem {
  const AttentionModel* model = nullptr;
  AttendCall call;
  AttendOutputs outputs;
  SteadyClock::time_point accepted;
  SteadyClock::time_point deadline = SteadyClock::time_point::max();
  /// Polled before compute; true drops the item with CANCELLED.
  std::function<bool()> cancelled;
  /// Runs exactly once, on a worker thread (or the submitter's when refused), with the outcome.
  std::function<void(const Status&, const WorkItem&)> done;

  // Filled on completion.
  double queue_seconds = 0;
  double compute_seconds = 0;
  int batch_size = 0;
};

/// Options of a WorkQueue. Defaults suit this 2-core machine.
struct WorkQueueOptions {
  int workers = 2;               ///< Compute threads; each runs one forward at a time.
  size_t max_queue_size = 1024;  ///< Accepted but not started items; beyond: RESOURCE_EXHAUSTED.
};

/// A bounded FIFO of WorkItems served by a pool of compute threads. Thread-safe.
class WorkQueue {
 public:
  explicit WorkQueue(const WorkQueueOptions& options);
  ~WorkQueue();  ///< Drains.
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  /// Takes the item. When it is refused (queue full: RESOURCE_EXHAUSTED; draining: UNAVAILABLE)
  /// its `done` runs before Submit returns.
  void Submit(std::unique_ptr<WorkItem> item);

  /// Stops accepting, finishes every queued item, joins the workers. Idempotent.
  void Drain();

 private:
  void WorkerLoop();
  static void Run(WorkItem& item);

  const WorkQueueOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<WorkItem>> queue_;
  bool draining_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace attnserve
