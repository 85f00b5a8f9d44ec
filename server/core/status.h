#pragma once

#include <optional>
#include <string>
#include <utility>

namespace attnserve {

/// Why an operation failed, in the server's own terms. Mapped to gRPC codes in one place
/// (grpc_status.cc); see docs/api.md "Errors".
enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  ///< The request is malformed, over a per-request limit, or names a bad field.
  kNotFound,         ///< The named model, version, memory or session is not there (any more).
  kUnavailable,      ///< The server is draining or stopping; retry elsewhere or later.
  kResourceExhausted,   ///< A queue, the in-flight byte budget, the kept-keys budget or device
                        ///< memory.
  kDeadlineExceeded,    ///< The deadline passed before or during compute (the answer is dropped).
  kCancelled,           ///< The client cancelled the call.
  kFailedPrecondition,  ///< Bad configuration or files: at start-up, in a reload, or a model
                        ///< without kept keys.
  kUnauthenticated,     ///< An admin call without valid credentials.
  kPermissionDenied,    ///< An admin call whose credentials are not an administrator's.
  kAborted,  ///< A session step that conflicts with another (in flight, or a length mismatch).
  kAlreadyExists,  ///< A shared-memory region name that is registered already.
  kInternal,       ///< Anything else from the engine.
};

/// Result of an operation: a code and, on failure, a message capped at 1 KiB.
class Status {
 public:
  /// A success.
  Status() = default;
  /// A failure (or success when `code` is kOk) with a message.
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  /// "INVALID_ARGUMENT: <message>".
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

/// Longest message a Status keeps; longer ones are cut and end in "...".
inline constexpr size_t kMaxStatusMessage = 1024;

/// Name of a code, e.g. "INVALID_ARGUMENT": the name of the gRPC code it maps to (grpc_status.h),
/// which is the metrics label `code`.
const char* StatusCodeName(StatusCode code);

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

/// A value or the Status that explains why there is none.
template <typename T>
class StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design.
  StatusOr(Status status) : status_(std::move(status)) {
    if (status_.ok()) status_ = Internal("StatusOr built from an OK status without a value");
  }
  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace attnserve

#define ATTNSERVE_CONCAT_INNER(a, b) a##b
#define ATTNSERVE_CONCAT(a, b) ATTNSERVE_CONCAT_INNER(a, b)

/// Returns from the enclosing function when `expr` (a Status) is not OK.
#define RETURN_IF_ERROR(expr)         \
  do {                                \
    ::attnserve::Status _st = (expr); \
    if (!_st.ok()) return _st;        \
  } while (0)

/// `lhs = value of expr` (a StatusOr), or returns its Status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(ATTNSERVE_CONCAT(_status_or_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
