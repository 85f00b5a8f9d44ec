#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/core/status.h"

namespace attnserve {

/// The access log (--access-log): one line per call, written by a background thread. Write never
/// blocks: past `max_lines` waiting, a line is dropped (counted). Lines are written whole, in the
/// order they came.
class AccessLog {
 public:
  /// `path` "-": standard output; otherwise the file, appended to (created if missing).
  /// FAILED_PRECONDITION naming --access-log when it cannot be opened.
  static StatusOr<std::unique_ptr<AccessLog>> Open(const std::string& path, size_t max_lines,
                                                   std::function<void()> on_dropped);
  ~AccessLog();  ///< Writes what is queued, then closes.

  void Write(std::string line);

 private:
  AccessLog(std::FILE* file, bool owned, size_t max_lines, std::function<void()> on_dropped);
  void Loop();

  std::FILE* const file_;
  const bool owned_;
  const size_t max_lines_;
  const std::function<void()> on_dropped_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> lines_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace attnserve
