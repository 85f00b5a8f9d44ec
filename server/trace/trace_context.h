#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace attnserve {

using TraceId = std::array<uint8_t, 16>;
using SpanId = std::array<uint8_t, 8>;

/// A W3C Trace Context parent (https://www.w3.org/TR/trace-context/): the caller's trace, its span,
/// and whether it sampled the trace.
struct TraceParent {
  TraceId trace_id{};
  SpanId span_id{};
  uint8_t flags = 0;
  bool sampled() const { return (flags & 1) != 0; }
};

/// What a call brought of its caller's trace: the parent when its `traceparent` was valid, and the
/// `tracestate` that goes with it (kept only beside a valid parent, as the spec says).
struct IncomingTrace {
  std::optional<TraceParent> parent;
  std::string tracestate;
};

/// Longest `tracestate` kept (the spec asks vendors to propagate at least 512 characters; a longer
/// one is dropped whole rather than cut inside a member).
inline constexpr size_t kMaxTracestate = 512;

/// `traceparent` as W3C Trace Context level 1 reads it: "vv-<32 hex>-<16 hex>-ff", lowercase hex;
/// version ff is invalid, version 00 is exactly 55 characters, a higher version may be longer with
/// a '-' after the flags; an all-zero trace id or span id is invalid. Anything else: nullopt (the
/// header is then ignored, never an error for the call).
std::optional<TraceParent> ParseTraceparent(std::string_view text);
/// The context a call's headers carry (either may be empty: absent).
IncomingTrace ReadIncoming(std::string_view traceparent, std::string_view tracestate);
/// "00-<trace>-<span>-<flags>".
std::string FormatTraceparent(const TraceId& trace, const SpanId& span, uint8_t flags);

/// Lowercase hex of an id.
std::string Hex(const uint8_t* bytes, size_t n);
inline std::string Hex(const TraceId& id) { return Hex(id.data(), id.size()); }
inline std::string Hex(const SpanId& id) { return Hex(id.data(), id.size()); }
bool IsZero(const uint8_t* bytes, size_t n);

/// Random, never all-zero ids (a per-thread generator seeded from the OS).
TraceId NewTraceId();
SpanId NewSpanId();

}  // namespace attnserve
