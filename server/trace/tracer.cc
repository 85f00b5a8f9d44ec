#include "server/trace/tracer.h"

#include <algorithm>
#include <cmath>

namespace attnserve {
namespace {

// OpenTelemetry's TraceIdRatioBased: the trace id's last 8 bytes, big-endian, below rate * 2^63
// (after dropping the top bit).
bool SampledByRatio(const TraceId& id, double rate) {
  if (rate >= 1) return true;
  if (rate <= 0) return false;
  uint64_t low = 0;
  for (int i = 8; i < 16; ++i) low = low << 8 | id[i];
  low &= ~(uint64_t{1} << 63);
  return static_cast<double>(low) < std::ldexp(rate, 63);
}

std::chrono::nanoseconds WallMinusSteady() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::system_clock::now().time_since_epoch() -
      std::chrono::steady_clock::now().time_since_epoch());
}

}  // namespace

Tracer::Tracer(double rate, SpanSink* sink)
    : rate_(std::clamp(rate, 0.0, 1.0)), sink_(sink), wall_minus_steady_(WallMinusSteady()) {}

CallTrace Tracer::Begin(const IncomingTrace& in) const {
  CallTrace t;
  if (!on()) return t;
  t.on = true;
  t.span_id = NewSpanId();
  if (in.parent) {
    t.trace_id = in.parent->trace_id;
    t.parent = in.parent->span_id;
    t.tracestate = in.tracestate;
    t.sampled = in.parent->sampled();
  } else {
    t.trace_id = NewTraceId();
    t.sampled = SampledByRatio(t.trace_id, rate_);
  }
  return t;
}

SpanData Tracer::ChildOf(const CallTrace& call, std::string name, Clock::time_point start,
                         Clock::time_point end) const {
  SpanData s;
  s.trace_id = call.trace_id;
  s.span_id = NewSpanId();
  s.parent_span_id = call.span_id;
  s.tracestate = call.tracestate;
  s.name = std::move(name);
  s.start_unix_nanos = UnixNanos(start);
  s.end_unix_nanos = UnixNanos(std::max(start, end));
  return s;
}

SpanData Tracer::ServerSpan(const CallTrace& call, std::string name, Clock::time_point start,
                            Clock::time_point end) const {
  SpanData s = ChildOf(call, std::move(name), start, end);
  s.span_id = call.span_id;
  s.parent_span_id = call.parent;
  s.kind = SpanKind::kServer;
  return s;
}

SpanData Tracer::Root(std::string name, Clock::time_point start, Clock::time_point end) const {
  CallTrace fresh;  // no span of its own: the span is a root
  fresh.trace_id = NewTraceId();
  return ChildOf(fresh, std::move(name), start, end);
}

void Tracer::Emit(SpanData span) const {
  if (sink_) sink_->Export(std::move(span));
}

int64_t Tracer::UnixNanos(Clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch() +
                                                              wall_minus_steady_)
      .count();
}

}  // namespace attnserve
