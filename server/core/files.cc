#include "server/core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace attnserve {

StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes) {
  const auto fail = [&](const std::string& what) {
    return Status(StatusCode::kFailedPrecondition, path + ": " + what);
  };
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return fail("not a regular file");
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    close(fd);
    return fail(std::to_string(st.st_size) + " bytes is over the limit of " +
                std::to_string(max_bytes));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = read(fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(fd);
      return fail(n < 0 ? std::string("read failed: ") + std::strerror(errno)
                        : "changed while being read");
    }
    got += static_cast<size_t>(n);
  }
  close(fd);
  return out;
}

}  // namespace attnserve
