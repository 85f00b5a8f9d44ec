#include "server/core/status.h"

#include <algorithm>

namespace attnserve {

namespace {

// The length of the well-formed UTF-8 character (RFC 3629) at s[i], or 0 when none starts there.
size_t Utf8Length(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  const size_t n = c >= 0xC2 && c <= 0xDF   ? 2
                   : (c & 0xF0) == 0xE0     ? 3
                   : c >= 0xF0 && c <= 0xF4 ? 4
                                            : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  }
  const auto c1 = static_cast<unsigned char>(s[i + 1]);
  if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0) || (c == 0xF0 && c1 < 0x90) ||
      (c == 0xF4 && c1 >= 0x90))
    return 0;  // Overlong, a surrogate, or past U+10FFFF.
  return n;
}

// `s` as well-formed UTF-8, each byte that starts no character replaced by '?', cut to at most
// `limit` bytes between characters (then ending in "..."): a message goes into proto3 strings
// (Error.message), which a receiver refuses whole when they are not UTF-8.
std::string Utf8Capped(const std::string& s, size_t limit) {
  std::string out;
  out.reserve(std::min(s.size(), limit));
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Length(s, i);
    if (out.size() + std::max<size_t>(n, 1) > limit - 3 && s.size() - i + out.size() > limit) {
      return out + "...";
    }
    if (n == 0) {
      out += '?';
      ++i;
    } else {
      out.append(s, i, n);
      i += n;
    }
  }
  return out;
}

}  // namespace

Status::Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {
  bool plain = message_.size() <= kMaxStatusMessage;
  for (size_t i = 0; plain && i < message_.size(); ++i) plain = message_[i] > 0;  // ASCII
  if (!plain) message_ = Utf8Capped(message_, kMaxStatusMessage);
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kCancelled:
      return "CANCELLED";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
    case StatusCode::kAborted:
      return "ABORTED";
    case StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case StatusCode::kInternal:
      return "INTERNAL";
  }
  return "UNKNOWN";
}

}  // namespace attnserve
