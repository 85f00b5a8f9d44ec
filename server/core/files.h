#pragma once

#include <cstdint>
#include <string>

#include "server/core/status.h"

namespace attnserve {

/// Reads a whole regular file of at most `max_bytes`; FAILED_PRECONDITION naming the file when it
/// cannot, or when it is not a regular file (a FIFO or device would block or never end). Every file
/// the server reads (weights, configs, PEM files, the admin token) comes through here.
StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes = uint64_t{1} << 36);

}  // namespace attnserve
