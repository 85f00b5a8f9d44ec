#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "attnserve/tensor.h"

namespace attnserve {

/// A POSIX shared memory object on this host, mapped into this process: a server on the same host
/// (started with --allow-shared-memory) reads a request's tensors from it and writes answers into
/// it once it is registered (Client::RegisterSharedMemory(name, key(), 0, size())), so the bytes
/// never cross the socket. Create() makes the object and unlinks it when destroyed; Open() maps
/// one that exists and leaves it. Not thread-safe for concurrent writes to the same bytes.
class SharedMemoryRegion {
 public:
  /// A new object `key` ("/name": letters, digits, '.', '_', '-') of `byte_size` bytes, zeroed.
  /// Throws std::system_error when it cannot be made (it exists already, no space).
  static std::unique_ptr<SharedMemoryRegion> Create(const std::string& key, size_t byte_size);
  /// The object `key` as it is (its whole size). Throws std::system_error when it cannot.
  static std::unique_ptr<SharedMemoryRegion> Open(const std::string& key);
  ~SharedMemoryRegion();  ///< Unmaps; unlinks what Create made.
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& key() const { return key_; }
  size_t size() const { return size_; }
  char* data() { return data_; }
  const char* data() const { return data_; }

  /// Copies `t`'s bytes to `offset` and returns the tensor that names them in region `name` (what
  /// this region is registered as). Throws std::out_of_range when they do not fit.
  Tensor Put(const Tensor& t, const std::string& name, size_t offset = 0);
  /// The bytes of a tensor of `dtype` and `shape` at `offset` (an answer the server wrote), as a
  /// Tensor holding a copy. Throws std::out_of_range when they do not fit.
  Tensor Get(DataType dtype, std::vector<int64_t> shape, size_t offset = 0) const;

 private:
  SharedMemoryRegion(std::string key, char* data, size_t size, bool owner)
      : key_(std::move(key)), data_(data), size_(size), owner_(owner) {}
  std::string key_;
  char* data_;
  size_t size_;
  bool owner_;
};

}  // namespace attnserve
