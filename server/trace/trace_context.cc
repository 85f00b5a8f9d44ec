#include "server/trace/trace_context.h"

#include <random>

namespace attnserve {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // Uppercase is invalid in traceparent.
}

// Reads 2n lowercase hex characters into n bytes; false on anything else.
bool ReadHex(std::string_view text, uint8_t* out, size_t n) {
  if (text.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i) {
    const int hi = HexValue(text[2 * i]), lo = HexValue(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

std::mt19937_64& Generator() {
  thread_local std::mt19937_64 gen{[] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }()};
  return gen;
}

template <size_t N>
std::array<uint8_t, N> RandomId() {
  std::array<uint8_t, N> id{};
  do {
    for (size_t i = 0; i < N; i += 8) {
      const uint64_t r = Generator()();
      for (size_t j = 0; j < 8 && i + j < N; ++j) id[i + j] = static_cast<uint8_t>(r >> (8 * j));
    }
  } while (IsZero(id.data(), N));
  return id;
}

}  // namespace

std::optional<TraceParent> ParseTraceparent(std::string_view text) {
  // version "-" trace-id "-" parent-id "-" flags: 2 + 1 + 32 + 1 + 16 + 1 + 2.
  constexpr size_t kLength = 55;
  if (text.size() < kLength) return std::nullopt;
  uint8_t version = 0;
  if (!ReadHex(text.substr(0, 2), &version, 1) || version == 0xff) return std::nullopt;
  if (version == 0 && text.size() != kLength) return std::nullopt;
  if (text.size() > kLength && text[kLength] != '-') return std::nullopt;  // future versions
  if (text[2] != '-' || text[35] != '-' || text[52] != '-') return std::nullopt;
  TraceParent p;
  if (!ReadHex(text.substr(3, 32), p.trace_id.data(), 16) ||
      !ReadHex(text.substr(36, 16), p.span_id.data(), 8) ||
      !ReadHex(text.substr(53, 2), &p.flags, 1)) {
    return std::nullopt;
  }
  if (IsZero(p.trace_id.data(), 16) || IsZero(p.span_id.data(), 8)) return std::nullopt;
  if (version > 0) p.flags &= 1;  // Only the sampled flag is known; a later version's others drop.
  return p;
}

IncomingTrace ReadIncoming(std::string_view traceparent, std::string_view tracestate) {
  IncomingTrace in;
  in.parent = ParseTraceparent(traceparent);
  if (in.parent && tracestate.size() <= kMaxTracestate) in.tracestate = std::string(tracestate);
  return in;
}

std::string FormatTraceparent(const TraceId& trace, const SpanId& span, uint8_t flags) {
  return "00-" + Hex(trace) + "-" + Hex(span) + "-" + Hex(&flags, 1);
}

std::string Hex(const uint8_t* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

bool IsZero(const uint8_t* bytes, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (bytes[i] != 0) return false;
  }
  return true;
}

TraceId NewTraceId() { return RandomId<16>(); }
SpanId NewSpanId() { return RandomId<8>(); }

}  // namespace attnserve
