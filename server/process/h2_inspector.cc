#include "server/process/h2_inspector.h"

#include <algorithm>
#include <cstring>

namespace attnserve {
namespace {

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kPrefaceBytes = sizeof(kPreface) - 1;
constexpr uint8_t kData = 0, kHeaders = 1, kRstStream = 3, kSettings = 4, kContinuation = 9;
constexpr uint8_t kEndStream = 0x1, kAck = 0x1, kEndHeaders = 0x4, kPadded = 0x8;

uint32_t Be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Reads into a frame's 9-byte header; true once it is whole.
bool ReadHeader(const uint8_t* data, size_t n, size_t& i, int& have, uint8_t* header) {
  const size_t take = std::min<size_t>(9 - have, n - i);
  std::memcpy(header + have, data + i, take);
  have += static_cast<int>(take);
  i += take;
  return have == 9;
}

}  // namespace

H2Inspector::H2Inspector(const H2Limits& limits, StreamAccount* account)
    : limits_(limits), account_(account), settings_tokens_(limits.settings_burst) {}

H2Inspector::~H2Inspector() {
  for (const auto& [id, s] : streams_) {
    account_->RemovePartial(s.partial);
    account_->CloseStream();
  }
}

H2Breach H2Inspector::OnReceived(const uint8_t* data, size_t n,
                                 std::chrono::steady_clock::time_point now) {
  if (off_) return {};
  size_t i = 0;
  for (; preface_have_ < kPrefaceBytes && i < n; ++preface_have_, ++i) {
    if (data[i] != static_cast<uint8_t>(kPreface[preface_have_])) {
      off_ = true;  // Not HTTP/2: gRPC refuses it.
      return {};
    }
  }
  if (H2Breach late = Overdue(now); late) return late;
  while (i < n) {
    if (in_.header_have < 9 || in_.payload_left == 0) {
      if (in_.header_have == 9) in_.header_have = 0;  // The last frame had no payload left.
      if (!ReadHeader(data, n, i, in_.header_have, in_.header)) break;
      if (H2Breach broken = OnFrameHeader(now); broken) return broken;
      continue;
    }
    const size_t take = static_cast<size_t>(std::min<int64_t>(in_.payload_left, n - i));
    if (in_.type == kData) {
      if (H2Breach broken = OnData(data + i, take); broken) return broken;
    }
    in_.offset += static_cast<int64_t>(take);
    in_.payload_left -= static_cast<int64_t>(take);
    i += take;
  }
  return {};
}

H2Breach H2Inspector::Overdue(std::chrono::steady_clock::time_point now) const {
  if (!in_block_ || now - block_started_ <= limits_.header_timeout) return {};
  return {"header_timeout",
          "a header block still incomplete after " +
              std::to_string(
                  std::chrono::duration_cast<std::chrono::seconds>(now - block_started_).count()) +
              " s (--header-timeout-seconds)"};
}

H2Breach H2Inspector::OnFrameHeader(std::chrono::steady_clock::time_point now) {
  const uint8_t* h = in_.header;
  in_.payload_left = (int64_t{h[0]} << 16) | (int64_t{h[1]} << 8) | h[2];
  in_.type = h[3];
  in_.flags = h[4];
  in_.stream = Be32(h + 5) & 0x7FFFFFFFu;
  in_.offset = 0;
  in_.pad = in_.type == kData && (in_.flags & kPadded) ? -1 : 0;
  if (in_block_ && in_.type != kContinuation) in_block_ = false;  // gRPC's protocol error.
  const int64_t length = in_.payload_left;
  if (in_.type == kHeaders || (in_.type == kData && length > 0)) account_->Active();
  if (in_.type == kHeaders) {
    const uint32_t id = in_.stream;
    if (id % 2 == 1 && id > last_opened_) {
      if (open_streams() >= 2 * limits_.max_concurrent_streams) {
        return {"streams", "more than twice --max-concurrent-streams (" +
                               std::to_string(limits_.max_concurrent_streams) +
                               ") streams open at once on one connection"};
      }
      if (H2Breach refused = account_->OpenStream()) return refused;
      streams_.emplace(id, Stream{});
      last_opened_ = id;
      if (H2Breach broken = Window(now, false); broken) return broken;
    }
    in_block_ = !(in_.flags & kEndHeaders);
    block_bytes_ = length;
    block_frames_ = 1;
    block_started_ = now;
  } else if (in_.type == kContinuation && in_block_) {
    block_bytes_ += length;
    ++block_frames_;
    in_block_ = !(in_.flags & kEndHeaders);
  } else if (in_.type == kRstStream) {
    if (H2Breach broken = Window(now, true); broken) return broken;
    Close(in_.stream);
  } else if (in_.type == kSettings && !(in_.flags & kAck)) {
    if (H2Breach broken = Settings(now); broken) return broken;
  }
  if (in_.type == kHeaders || in_.type == kContinuation) {
    if (block_bytes_ > limits_.max_header_block_bytes) {
      return {"header_bytes", "a header block of at least " + std::to_string(block_bytes_) +
                                  " bytes, over " + std::to_string(limits_.max_header_block_bytes) +
                                  " (--max-header-bytes)"};
    }
    if (block_frames_ > limits_.max_header_block_frames) {
      return {"header_frames", "a header block cut into more than " +
                                   std::to_string(limits_.max_header_block_frames) + " frames"};
    }
    if (now - block_started_ > limits_.header_timeout) {
      return {"header_timeout", "a header block still incomplete after --header-timeout-seconds"};
    }
  }
  return {};
}

H2Breach H2Inspector::OnData(const uint8_t* data, size_t n) {
  size_t j = 0;
  if (in_.pad < 0 && n > 0) {  // A padded frame's first byte: its pad length.
    in_.pad = data[0];
    j = 1;
  }
  const auto it = streams_.find(in_.stream);
  if (it == streams_.end()) return {};  // Closed, or never opened: gRPC ignores or refuses it.
  const int64_t length = in_.offset + in_.payload_left;
  const int64_t data_end = length - std::max(in_.pad, 0);
  const int64_t start = in_.offset + static_cast<int64_t>(j);
  const int64_t end = std::min<int64_t>(in_.offset + static_cast<int64_t>(n), data_end);
  if (end <= start) return {};
  return Message(it->second, data + j, static_cast<size_t>(end - start));
}

H2Breach H2Inspector::Message(Stream& s, const uint8_t* data, size_t n) {
  while (n > 0) {
    const bool prefix = s.message_left == 0;  // The 5-byte prefix: compressed flag, length.
    const size_t take = prefix ? std::min<size_t>(5 - s.prefix_have, n)
                               : static_cast<size_t>(std::min<int64_t>(s.message_left, n));
    if (H2Breach refused = account_->AddPartial(static_cast<int64_t>(take))) return refused;
    s.partial += static_cast<int64_t>(take);
    partial_ += static_cast<int64_t>(take);
    bool complete = false;
    if (prefix) {
      std::memcpy(s.prefix + s.prefix_have, data, take);
      s.prefix_have += static_cast<int>(take);
      if (s.prefix_have == 5) {
        const int64_t announced = Be32(s.prefix + 1);
        if (announced > limits_.max_message_bytes) {
          return {"message_bytes",
                  "a message of " + std::to_string(announced) + " bytes announced, over " +
                      std::to_string(limits_.max_message_bytes) + " (--max-upload-bytes-per-peer)"};
        }
        s.prefix_have = 0;
        s.message_left = announced;
        complete = announced == 0;
      }
    } else {
      s.message_left -= static_cast<int64_t>(take);
      complete = s.message_left == 0;
    }
    if (complete) {  // gRPC hands a whole message on: counted by the request's budget from here.
      account_->RemovePartial(s.partial);
      partial_ -= s.partial;
      s.partial = 0;
    }
    data += take;
    n -= take;
  }
  return {};
}

// Counts by the second: a second in which the client reset more than resets_per_second streams,
// more than half of those it opened, breaks the bound when it ends (at the next stream opened or
// reset), or at once past ten times the rate.
H2Breach H2Inspector::Window(std::chrono::steady_clock::time_point now, bool reset) {
  const auto rapid = [this](double rate) {
    return window_resets_ > rate && 2 * window_resets_ > window_opened_;
  };
  if (now - window_ >= std::chrono::seconds(1)) {
    const bool was_rapid = rapid(limits_.resets_per_second);
    window_ = now;
    window_opened_ = window_resets_ = 0;
    if (was_rapid) {
      return {"resets", "more than " +
                            std::to_string(static_cast<int64_t>(limits_.resets_per_second)) +
                            " streams reset in a second, most of those it opened (rapid reset; "
                            "--max-resets-per-second)"};
    }
  }
  ++(reset ? window_resets_ : window_opened_);
  if (rapid(10 * limits_.resets_per_second)) {
    return {"resets",
            "more than ten times --max-resets-per-second streams reset in a second, "
            "most of those it opened (rapid reset)"};
  }
  return {};
}

H2Breach H2Inspector::Settings(std::chrono::steady_clock::time_point now) {
  const double seconds = std::chrono::duration<double>(now - settings_refilled_).count();
  settings_tokens_ =
      std::min(limits_.settings_burst, settings_tokens_ + seconds * limits_.settings_per_second);
  settings_refilled_ = now;
  if (settings_tokens_ < 1) {
    return {"settings", "SETTINGS frames faster than " +
                            std::to_string(static_cast<int64_t>(limits_.settings_per_second)) +
                            " a second (each one's acknowledgement waits in gRPC's queue)"};
  }
  settings_tokens_ -= 1;
  return {};
}

void H2Inspector::OnSent(const uint8_t* data, size_t n) {
  if (off_) return;
  size_t i = 0;
  while (i < n) {
    if (out_.header_have < 9 || out_.payload_left == 0) {
      if (out_.header_have == 9) out_.header_have = 0;
      if (!ReadHeader(data, n, i, out_.header_have, out_.header)) break;
      const uint8_t* h = out_.header;
      out_.payload_left = (int64_t{h[0]} << 16) | (int64_t{h[1]} << 8) | h[2];
      const uint8_t type = h[3], flags = h[4];
      // The server ended the stream: its trailers, or a reset.
      if (((type == kHeaders || type == kData) && (flags & kEndStream)) || type == kRstStream) {
        Close(Be32(h + 5) & 0x7FFFFFFFu);
      }
      continue;
    }
    const size_t take = static_cast<size_t>(std::min<int64_t>(out_.payload_left, n - i));
    out_.payload_left -= static_cast<int64_t>(take);
    i += take;
  }
}

void H2Inspector::Close(uint32_t id) {
  const auto it = streams_.find(id);
  if (it == streams_.end()) return;
  account_->RemovePartial(it->second.partial);
  partial_ -= it->second.partial;
  account_->CloseStream();
  streams_.erase(it);
}

}  // namespace attnserve
