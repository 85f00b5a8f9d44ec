#pragma once

#include <chrono>
#include <string>

#include "server/trace/span.h"
#include "server/trace/trace_context.h"

namespace attnserve {

/// A call's place in a trace: the ids its spans take, and whether they are recorded. With tracing
/// off (no exporter) nothing is set and nothing is ever made.
struct CallTrace {
  bool on = false;       ///< Tracing is configured: the ids below exist (logs, error metadata).
  bool sampled = false;  ///< The call's spans are exported.
  TraceId trace_id{};
  SpanId span_id{};  ///< The call's own (server) span.
  SpanId parent{};   ///< The caller's span; zero: the call's span is a root.
  std::string tracestate;

  std::string trace_id_hex() const { return on ? Hex(trace_id) : std::string(); }
};

/// Decides which calls are traced and stamps their spans. Thread-safe (const after construction).
///
/// Sampling is parent-based: a call whose valid `traceparent` says sampled is traced, one that says
/// not sampled is not; a call with no valid parent starts a trace of its own, sampled with
/// probability `rate` (by its trace id, so every server agrees on a trace: OpenTelemetry's
/// TraceIdRatioBased). rate 0 (the default of --trace-rate): only calls that arrive sampled.
class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  /// `sink` null: tracing off (Begin returns an empty CallTrace, Emit does nothing). Borrowed.
  Tracer(double rate, SpanSink* sink);

  bool on() const { return sink_ != nullptr; }
  double rate() const { return rate_; }
  /// The trace a call with this incoming context joins or starts.
  CallTrace Begin(const IncomingTrace& in) const;
  /// A span of the call: its trace, a new span id, the call's span as parent.
  SpanData ChildOf(const CallTrace& call, std::string name, Clock::time_point start,
                   Clock::time_point end) const;
  /// The call's own span (kind server), the caller's span as parent.
  SpanData ServerSpan(const CallTrace& call, std::string name, Clock::time_point start,
                      Clock::time_point end) const;
  /// A span that begins a trace of its own (a batch that carried several calls).
  SpanData Root(std::string name, Clock::time_point start, Clock::time_point end) const;
  /// Hands a finished span to the exporter (never blocks).
  void Emit(SpanData span) const;
  /// Nanoseconds since the Unix epoch of a steady-clock time.
  int64_t UnixNanos(Clock::time_point t) const;

 private:
  const double rate_;
  SpanSink* const sink_;
  // The system clock at construction minus the steady clock then: spans' times are steady (never
  // step backwards) and shown on the wall clock.
  const std::chrono::nanoseconds wall_minus_steady_;
};

}  // namespace attnserve
