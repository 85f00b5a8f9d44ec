#include "server/work_queue.h"

namespace attnserve {
namespace {
double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

WorkQueue::WorkQueue(const WorkQueueOptions& options) : options_(options) {
  for (int i = 0; i < options_.workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

WorkQueue::~WorkQueue() { Drain(); }

void WorkQueue::Submit(std::unique_ptr<WorkItem> item) {
  Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) {
      refused = Status(StatusCode::kUnavailable, "server is shutting down; retry on another replica");
    } else if (queue_.size() >= options_.max_queue_size) {
      refused = Status(StatusCode::kResourceExhausted,
                       "queue full: " + std::to_string(queue_.size()) +
                           " requests waiting (server flag --max-queue-size); retry later");
    } else {
      queue_.push_back(std::move(item));
    }
  }
  if (!refused.ok()) {
    item->done(refused, *item);
    return;
  }
  cv_.notify_one();
}

void WorkQueue::Drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void WorkQueue::WorkerLoop() {
  for (;;) {
    std::unique_ptr<WorkItem> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return draining_ || !queue_.empty(); });
      if (queue_.empty()) return;  // Draining and nothing left.
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(*item);
  }
}

void WorkQueue::Run(WorkItem& item) {
  const auto start = SteadyClock::now();
  item.queue_seconds = Seconds(start - item.accepted);
  item.batch_size = 1;
  Status status;
  // The deadline first: gRPC also marks a call whose deadline passed as cancelled.
  if (start >= item.deadline) {
    status = Status(StatusCode::kDeadlineExceeded,
                    "deadline passed after " + std::to_string(item.queue_seconds) +
                        " s in the queue, before compute started");
  } else if (item.cancelled && item.cancelled()) {
    status = Status(StatusCode::kCancelled, "cancelled by the client before compute");
  } else {
    status = item.model->Forward(item.call, &item.outputs);
    item.compute_seconds = Seconds(SteadyClock::now() - start);
  }
  item.done(status, item);
}

}  // namespace attnserve
