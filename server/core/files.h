#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "server/core/status.h"

namespace attnserve {

/// Reads a whole regular file of at most `max_bytes`; FAILED_PRECONDITION naming the file when it
/// cannot, or when it is not a regular file (a FIFO or device would block or never end). Every file
/// the server reads (weights, configs, PEM files, the admin token) comes through here.
StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes = uint64_t{1} << 36);

/// A regular file open for reads of byte ranges (a checkpoint's few tensors out of a whole model's
/// file). Open refuses what ReadFile refuses; messages name the file.
class FileRanges {
 public:
  static StatusOr<FileRanges> Open(const std::string& path);
  FileRanges(FileRanges&& other) noexcept : fd_(other.fd_), size_(other.size_), path_(other.path_) {
    other.fd_ = -1;
  }
  FileRanges& operator=(FileRanges&&) = delete;
  FileRanges(const FileRanges&) = delete;
  ~FileRanges();
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  /// `length` bytes at `offset`; FAILED_PRECONDITION when they lie past the end or the read fails.
  StatusOr<std::string> Read(uint64_t offset, uint64_t length) const;

 private:
  FileRanges(int fd, uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  int fd_;
  uint64_t size_;
  std::string path_;
};

}  // namespace attnserve
