#include "server/grpc/send_watch.h"

#include <vector>

namespace attnserve {
namespace {

// How often the watch looks: a call is cancelled at most this long after its time is up.
constexpr std::chrono::milliseconds kLookEvery{100};

}  // namespace

SendWatch::~SendWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SendWatch::SetTimeout(std::chrono::steady_clock::duration timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  timeout_ = timeout;
  if (timeout_ > std::chrono::steady_clock::duration::zero() && !thread_.joinable()) {
    thread_ = std::thread([this] { Run(); });
  }
  wake_.notify_all();
}

std::chrono::steady_clock::duration SendWatch::timeout() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeout_;
}

void SendWatch::SetCap(std::chrono::steady_clock::duration cap) {
  std::lock_guard<std::mutex> lock(mu_);
  cap_ = cap;
  if (cap_ > std::chrono::steady_clock::duration::zero() && !thread_.joinable()) {
    thread_ = std::thread([this] { Run(); });
  }
  wake_.notify_all();
}

void SendWatch::Handed(grpc::ServerContextBase* ctx, int64_t bytes) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (timeout_ > std::chrono::steady_clock::duration::zero() ||
      cap_ > std::chrono::steady_clock::duration::zero()) {
    handed_[ctx] = Handover{now, bytes};
  }
}

std::chrono::steady_clock::time_point SendWatch::Due(const Handover& h) const {
  using Duration = std::chrono::steady_clock::duration;
  Duration allowed = Duration::max();
  if (timeout_ > Duration::zero()) {
    allowed = timeout_ + std::chrono::duration_cast<Duration>(std::chrono::duration<double>(
                             static_cast<double>(h.bytes) / kSlowestRate));
  }
  if (cap_ > Duration::zero()) allowed = std::min(allowed, cap_);
  return allowed == Duration::max() ? std::chrono::steady_clock::time_point::max() : h.at + allowed;
}

void SendWatch::Taken(grpc::ServerContextBase* ctx) {
  std::lock_guard<std::recursive_mutex> cancelling(cancelling_);
  std::lock_guard<std::mutex> lock(mu_);
  handed_.erase(ctx);
}

void SendWatch::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    wake_.wait_for(lock, kLookEvery);
    if (stop_) continue;
    const auto now = std::chrono::steady_clock::now();
    std::vector<grpc::ServerContextBase*> late;
    for (const auto& [ctx, handed] : handed_) {
      if (Due(handed) <= now) late.push_back(ctx);
    }
    if (late.empty()) continue;
    lock.unlock();
    {
      // No call of `late` can end (Taken) until its cancellation is done; one that ended before
      // is no longer watched.
      std::lock_guard<std::recursive_mutex> cancelling(cancelling_);
      for (grpc::ServerContextBase* ctx : late) {
        {
          std::lock_guard<std::mutex> relock(mu_);
          const auto it = handed_.find(ctx);
          if (it == handed_.end() || Due(it->second) > now) continue;
          handed_.erase(it);
        }
        cancelled_.fetch_add(1);
        ctx->TryCancel();
      }
    }
    lock.lock();
  }
}

}  // namespace attnserve
