#include "attnserve/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace attnserve {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

char* Map(int fd, size_t size, const std::string& key) {
  void* p = size ? ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : nullptr;
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    errno = err;
    Fail("shared memory " + key + ": mmap");
  }
  ::close(fd);
  return static_cast<char*>(p);
}

}  // namespace

std::unique_ptr<SharedMemoryRegion> SharedMemoryRegion::Create(const std::string& key,
                                                               size_t byte_size) {
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) Fail("shared memory " + key + ": shm_open");
  if (::ftruncate(fd, static_cast<off_t>(byte_size)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(key.c_str());
    errno = err;
    Fail("shared memory " + key + ": ftruncate");
  }
  char* data = Map(fd, byte_size, key);
  return std::unique_ptr<SharedMemoryRegion>(new SharedMemoryRegion(key, data, byte_size, true));
}

std::unique_ptr<SharedMemoryRegion> SharedMemoryRegion::Open(const std::string& key) {
  const int fd = ::shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) Fail("shared memory " + key + ": shm_open");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    Fail("shared memory " + key + ": fstat");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  char* data = Map(fd, size, key);
  return std::unique_ptr<SharedMemoryRegion>(new SharedMemoryRegion(key, data, size, false));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (owner_) ::shm_unlink(key_.c_str());
}

Tensor SharedMemoryRegion::Put(const Tensor& t, const std::string& name, size_t offset) {
  if (offset > size_ || t.data.size() > size_ - offset) {
    throw std::out_of_range("shared memory " + key_ + ": " + std::to_string(t.data.size()) +
                            " bytes at offset " + std::to_string(offset) + " do not fit its " +
                            std::to_string(size_));
  }
  std::memcpy(data_ + offset, t.data.data(), t.data.size());
  Tensor out{t.dtype, t.shape, {}, std::nullopt};
  out.shared_memory =
      SharedMemoryRef{name, static_cast<int64_t>(offset), static_cast<int64_t>(t.data.size())};
  return out;
}

Tensor SharedMemoryRegion::Get(DataType dtype, std::vector<int64_t> shape, size_t offset) const {
  Tensor out{dtype, std::move(shape), {}, std::nullopt};
  const size_t bytes = static_cast<size_t>(out.byte_size());
  if (offset > size_ || bytes > size_ - offset) {
    throw std::out_of_range("shared memory " + key_ + ": " + std::to_string(bytes) +
                            " bytes at offset " + std::to_string(offset) + " do not fit its " +
                            std::to_string(size_));
  }
  out.data.assign(data_ + offset, bytes);
  return out;
}

}  // namespace attnserve
