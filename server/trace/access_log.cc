#include "server/trace/access_log.h"

#include <cerrno>
#include <cstring>

namespace attnserve {

StatusOr<std::unique_ptr<AccessLog>> AccessLog::Open(const std::string& path, size_t max_lines,
                                                     std::function<void()> on_dropped) {
  if (path == "-") {
    return std::unique_ptr<AccessLog>(
        new AccessLog(stdout, false, max_lines, std::move(on_dropped)));
  }
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f) {
    return Status(StatusCode::kFailedPrecondition,
                  "--access-log " + path + ": cannot open for appending: " + std::strerror(errno));
  }
  return std::unique_ptr<AccessLog>(new AccessLog(f, true, max_lines, std::move(on_dropped)));
}

AccessLog::AccessLog(std::FILE* file, bool owned, size_t max_lines,
                     std::function<void()> on_dropped)
    : file_(file), owned_(owned), max_lines_(max_lines), on_dropped_(std::move(on_dropped)) {
  thread_ = std::thread([this] { Loop(); });
}

AccessLog::~AccessLog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
  if (owned_) std::fclose(file_);
}

void AccessLog::Write(std::string line) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lines_.size() < max_lines_) {
      lines_.push_back(std::move(line));
      cv_.notify_one();
      return;
    }
  }
  if (on_dropped_) on_dropped_();
}

void AccessLog::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || !lines_.empty(); });
    std::deque<std::string> batch;
    batch.swap(lines_);
    const bool last = stopping_;
    lock.unlock();
    for (const std::string& l : batch) {
      std::fwrite(l.data(), 1, l.size(), file_);
      std::fputc('\n', file_);
    }
    std::fflush(file_);
    lock.lock();
    if (last && lines_.empty()) return;
  }
}

}  // namespace attnserve
