#include "server/engine/parallel.h"

#include <algorithm>

namespace attnserve {
namespace {

class Serial final : public Parallel {
 public:
  int Width() const override { return 1; }
  void For(int64_t n, const std::function<void(int64_t)>& fn) const override {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
};

}  // namespace

const Parallel& SerialParallel() {
  static const Serial serial;
  return serial;
}

// One For() call: pieces are claimed through `next`; `helpers` (under the exchange's mutex) counts
// the threads inside RunPieces besides the owner, which waits for them before the job goes.
struct PieceExchange::Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0};
  int helpers = 0;
};

PieceExchange::PieceExchange(std::function<int()> width, std::function<void()> wake)
    : width_(std::move(width)), wake_(std::move(wake)) {}

void PieceExchange::RunPieces(Job* job) {
  for (int64_t i = job->next.fetch_add(1); i < job->n; i = job->next.fetch_add(1)) (*job->fn)(i);
}

void PieceExchange::For(int64_t n, const std::function<void(int64_t)>& fn) const {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(&job);
  }
  wake_();
  RunPieces(&job);  // Whatever no helper took, the owner runs.
  std::unique_lock<std::mutex> lock(mu_);
  jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
  // Pieces a helper took may still run; their results are visible once it has left (the mutex).
  helpers_done_.wait(lock, [&job] { return job.helpers == 0; });
}

bool PieceExchange::HasWork() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Job* j : jobs_) {
    if (j->next.load(std::memory_order_relaxed) < j->n) return true;
  }
  return false;
}

bool PieceExchange::Help() const {
  bool ran = false;
  for (;;) {
    Job* job = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Job* j : jobs_) {
        if (j->next.load(std::memory_order_relaxed) < j->n) {
          job = j;
          break;
        }
      }
      if (!job) return ran;
      ++job->helpers;
    }
    RunPieces(job);
    ran = true;
    std::lock_guard<std::mutex> lock(mu_);
    if (--job->helpers == 0) helpers_done_.notify_all();
  }
}

HelperPool::HelperPool(int threads)
    : threads_(std::max(0, threads)),
      exchange_([this] { return threads_ + 1; },
                [this] {
                  std::lock_guard<std::mutex> lock(mu_);
                  cv_.notify_all();
                }) {
  for (int i = 0; i < threads_; ++i) {
    helpers_.emplace_back([this] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_) {
        if (exchange_.HasWork()) {
          lock.unlock();
          exchange_.Help();
          lock.lock();
          continue;
        }
        cv_.wait(lock);
      }
    });
  }
}

HelperPool::~HelperPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

}  // namespace attnserve
