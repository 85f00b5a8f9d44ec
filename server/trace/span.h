#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "server/trace/trace_context.h"

namespace attnserve {

/// OpenTelemetry's span kinds that attnserve makes.
enum class SpanKind { kInternal = 1, kServer = 2 };

using AttributeValue = std::variant<std::string, int64_t, double, bool>;
struct SpanAttribute {
  std::string key;
  AttributeValue value;
};

struct SpanLink {
  TraceId trace_id{};
  SpanId span_id{};
};

/// One finished span, as it is exported.
struct SpanData {
  TraceId trace_id{};
  SpanId span_id{};
  SpanId parent_span_id{};  ///< All zero: a root span.
  std::string tracestate;
  std::string name;
  SpanKind kind = SpanKind::kInternal;
  int64_t start_unix_nanos = 0;
  int64_t end_unix_nanos = 0;
  std::vector<SpanAttribute> attributes;
  std::vector<SpanLink> links;
  bool error = false;         ///< OTLP status ERROR (else UNSET).
  std::string error_message;  ///< With `error`.

  void Set(std::string key, AttributeValue value) {
    attributes.push_back({std::move(key), std::move(value)});
  }
};

/// Where finished spans go. Export never blocks the caller (it may drop).
class SpanSink {
 public:
  virtual ~SpanSink() = default;
  virtual void Export(SpanData span) = 0;
};

}  // namespace attnserve
