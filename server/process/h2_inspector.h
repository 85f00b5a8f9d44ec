#pragma once
// What a plaintext HTTP/2 connection's client sends and its server answers, read frame by frame as
// the bytes pass (no copy, no parsing of header contents), so that the bounds gRPC 1.51 does not
// keep are kept before its parser sees a byte (docs/grpc-workarounds.md). Pure: no sockets, no
// clocks of its own; the connection guard feeds it.

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>

namespace attnserve {

/// One connection's bounds (flags in docs/flags.md "Transport").
struct H2Limits {
  /// Streams open at once on the connection (the server's SETTINGS_MAX_CONCURRENT_STREAMS). gRPC
  /// 1.51 keeps it only once the client has acknowledged it; the inspector closes a connection past
  /// twice it, acknowledged or not (a stream's end is seen when its last frame is written, a
  /// moment after the client may see it: the slack keeps a client that waits for answers clear).
  int64_t max_concurrent_streams = 128;
  /// Bytes of one header block (HEADERS and its CONTINUATION frames, as sent: HPACK-coded).
  int64_t max_header_block_bytes = int64_t{32} << 10;
  /// Frames of one header block: a block cut into tiny CONTINUATION frames costs gRPC 1.51's parser
  /// a copy of the whole block per frame (CVE-2023-33953).
  int64_t max_header_block_frames = 16;
  /// How long one header block may take to arrive whole.
  std::chrono::steady_clock::duration header_timeout = std::chrono::seconds(10);
  /// The largest gRPC message a stream may announce (its 5-byte prefix); bigger closes the
  /// connection before its bytes arrive (gRPC 1.51 reads a message whole before it checks its
  /// size). The server sets it to the peer's upload bound, which such a message could never pass
  /// whole.
  int64_t max_message_bytes = int64_t{64} << 20;
  /// Streams the client may reset (RST_STREAM) in one second while it resets more than half of the
  /// streams it opens in that second (judged when the second ends; at once past ten times it):
  /// beyond, a rapid-reset flood (CVE-2023-44487). A client whose calls time out resets a share of
  /// them, not most.
  double resets_per_second = 200;
  /// SETTINGS frames (each answered with an acknowledgement gRPC queues) the client may send per
  /// second, on average, and at once.
  double settings_per_second = 10;
  double settings_burst = 100;
};

/// What a client broke: `reason` (a metrics label) and a sentence for the log; empty when nothing.
struct H2Breach {
  const char* reason = nullptr;
  std::string detail;
  explicit operator bool() const { return reason != nullptr; }
};

/// Where a connection's open streams and the bytes of its incomplete messages are also counted (its
/// peer's and the listener's accounts). Each call may refuse: the breach, or an empty one.
class StreamAccount {
 public:
  virtual ~StreamAccount() = default;
  virtual H2Breach OpenStream() = 0;
  virtual void CloseStream() = 0;
  virtual H2Breach AddPartial(int64_t bytes) = 0;
  virtual void RemovePartial(int64_t bytes) = 0;
  /// The client sent a call (HEADERS) or a message's bytes (DATA): it is at work.
  virtual void Active() {}
};

/// One plaintext HTTP/2 server connection, both directions. OnReceived returns what the client
/// broke (empty when nothing): the connection is then to be closed, and the inspector is not fed
/// again. Not thread-safe (the guard serializes a connection's reads and writes); on destruction
/// every stream still open is given back to the account.
class H2Inspector {
 public:
  H2Inspector(const H2Limits& limits, StreamAccount* account);
  ~H2Inspector();
  H2Inspector(const H2Inspector&) = delete;
  H2Inspector& operator=(const H2Inspector&) = delete;

  H2Breach OnReceived(const uint8_t* data, size_t n, std::chrono::steady_clock::time_point now);
  void OnSent(const uint8_t* data, size_t n);
  /// What a client that went silent in the middle of a header block broke once its time is out
  /// (the guard looks every second; OnReceived looks as bytes arrive).
  H2Breach Overdue(std::chrono::steady_clock::time_point now) const;

  int64_t open_streams() const { return static_cast<int64_t>(streams_.size()); }
  int64_t partial_bytes() const { return partial_; }

 private:
  struct Stream {
    uint8_t prefix[5] = {};
    int prefix_have = 0;
    int64_t message_left = 0;  // Bytes of the current message still to come (after its prefix).
    int64_t partial = 0;       // Bytes received of the current, incomplete message.
  };
  struct Frame {  // The frame being read in one direction.
    uint8_t header[9] = {};
    int header_have = 0;
    int64_t payload_left = 0;
    uint8_t type = 0, flags = 0;
    uint32_t stream = 0;
    int64_t offset = 0;  // Bytes of its payload read so far.
    int pad = -1;        // A padded DATA frame's pad length, once read.
  };

  H2Breach OnFrameHeader(std::chrono::steady_clock::time_point now);
  H2Breach OnData(const uint8_t* data, size_t n);
  H2Breach Message(Stream& s, const uint8_t* data, size_t n);
  H2Breach Window(std::chrono::steady_clock::time_point now, bool reset);
  H2Breach Settings(std::chrono::steady_clock::time_point now);
  void Close(uint32_t id);

  const H2Limits limits_;
  StreamAccount* const account_;
  size_t preface_have_ = 0;
  bool off_ = false;  // Not HTTP/2 (gRPC closes it): nothing more is read.
  Frame in_, out_;
  std::unordered_map<uint32_t, Stream> streams_;
  uint32_t last_opened_ = 0;
  int64_t partial_ = 0;
  bool in_block_ = false;
  int64_t block_bytes_ = 0, block_frames_ = 0;
  std::chrono::steady_clock::time_point block_started_{};
  std::chrono::steady_clock::time_point window_{};  // The second streams and resets count in.
  int64_t window_opened_ = 0, window_resets_ = 0;
  double settings_tokens_;
  std::chrono::steady_clock::time_point settings_refilled_{};
};

}  // namespace attnserve
