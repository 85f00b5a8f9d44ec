#include "server/core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace attnserve {
namespace {

// The most one read asks for: a process's exit waits for every read under way, and a whole model
// file in one call (hundreds of MiB from a slow disk) could take seconds; in pieces, a stop during
// a model's load ends within one piece.
constexpr size_t kReadPiece = size_t{64} << 20;

}  // namespace

StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes) {
  // Through FileRanges: its descriptor is closed on every way out, a failed allocation's included.
  ASSIGN_OR_RETURN(const FileRanges file, FileRanges::Open(path));
  if (file.size() > max_bytes) {
    return Status(StatusCode::kFailedPrecondition, path + ": " + std::to_string(file.size()) +
                                                       " bytes is over the limit of " +
                                                       std::to_string(max_bytes));
  }
  return file.Read(0, file.size());
}

StatusOr<FileRanges> FileRanges::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return Status(StatusCode::kFailedPrecondition,
                  path + ": cannot open: " + std::string(std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return Status(StatusCode::kFailedPrecondition, path + ": not a regular file");
  }
  return FileRanges(fd, static_cast<uint64_t>(st.st_size), path);
}

FileRanges::~FileRanges() {
  if (fd_ >= 0) close(fd_);
}

StatusOr<std::string> FileRanges::Read(uint64_t offset, uint64_t length) const {
  const auto fail = [&](const std::string& what) {
    return Status(StatusCode::kFailedPrecondition, path_ + ": " + what);
  };
  if (offset > size_ || length > size_ - offset) {
    return fail("bytes [" + std::to_string(offset) + ", +" + std::to_string(length) +
                ") lie past its end (" + std::to_string(size_) + " bytes)");
  }
  std::string out(static_cast<size_t>(length), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = pread(fd_, out.data() + got, std::min(out.size() - got, kReadPiece),
                            static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return fail(n < 0 ? std::string("read failed: ") + std::strerror(errno)
                        : "changed while being read");
    }
    got += static_cast<size_t>(n);
  }
  return out;
}

}  // namespace attnserve
