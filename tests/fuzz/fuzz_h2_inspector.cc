// The HTTP/2 inspector (server/process/h2_inspector.h) under any bytes a client may send and any
// frames a server may write, as a state machine: the input's first byte picks the limits, then each
// step (its first byte) either feeds the client's next bytes, in pieces of a size the step picks,
// or writes a server frame ending one of the streams seen. Two inspectors read the same client
// bytes, one whole step at a time, one in the step's pieces; after every step: both give the same
// verdict and the same counts, their accounts equal their own counts, nothing is negative; at the
// end each gives back to its account exactly what it took.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "server/process/h2_inspector.h"

namespace {

using attnserve::H2Breach;

struct Account final : attnserve::StreamAccount {
  int64_t streams = 0, partial = 0;
  H2Breach OpenStream() override {
    ++streams;
    return {};
  }
  void CloseStream() override { --streams; }
  H2Breach AddPartial(int64_t bytes) override {
    partial += bytes;
    return {};
  }
  void RemovePartial(int64_t bytes) override { partial -= bytes; }
};

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "broken invariant: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  attnserve::H2Limits limits;
  limits.max_concurrent_streams = 1 + data[0] % 8;
  limits.max_header_block_bytes = 64 + data[1];
  limits.max_message_bytes = 1 << (data[0] % 24);
  limits.resets_per_second = 1 + data[1] % 4;
  Account whole_account, pieces_account;
  {
    attnserve::H2Inspector whole(limits, &whole_account), pieces(limits, &pieces_account);
    static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const auto* preface = reinterpret_cast<const uint8_t*>(kPreface);
    Check(!whole.OnReceived(preface, 24, std::chrono::steady_clock::time_point{}) &&
              !pieces.OnReceived(preface, 24, std::chrono::steady_clock::time_point{}),
          "the preface breaks nothing");
    auto now = std::chrono::steady_clock::time_point{} + std::chrono::seconds(1);
    bool broken = false;
    for (size_t at = 2; at + 1 < size && !broken;) {
      const uint8_t op = data[at++];
      const size_t n = std::min<size_t>(size - at, 1 + op % 64);
      now += std::chrono::milliseconds(op % 16 * 100);
      if (op & 0x80) {
        // The server ends a stream: HEADERS with END_STREAM, or RST_STREAM.
        const uint8_t id = static_cast<uint8_t>(1 + 2 * (data[at] % 16));
        const uint8_t frame[9] = {0, 0, 0, static_cast<uint8_t>(op & 1 ? 3 : 1), 1, 0, 0, 0, id};
        whole.OnSent(frame, sizeof frame);
        for (size_t i = 0; i < sizeof frame; ++i) pieces.OnSent(frame + i, 1);
        at += 1;
      } else {
        const H2Breach a = whole.OnReceived(data + at, n, now);
        H2Breach b;
        const size_t piece = 1 + op % 7;
        for (size_t i = 0; i < n && !b; i += piece) {
          b = pieces.OnReceived(data + at + i, std::min(piece, n - i), now);
        }
        Check(bool(a) == bool(b), "pieces give the same verdict");
        broken = bool(a);
        at += n;
      }
      Check(whole.open_streams() == pieces.open_streams(), "pieces give the same streams");
      Check(whole.partial_bytes() == pieces.partial_bytes(), "pieces give the same partial bytes");
      Check(whole_account.streams == whole.open_streams(), "the account holds the streams");
      Check(whole_account.partial == whole.partial_bytes(), "the account holds the bytes");
      Check(whole.partial_bytes() >= 0 && whole.open_streams() >= 0, "nothing negative");
    }
  }
  Check(whole_account.streams == 0 && whole_account.partial == 0, "everything given back");
  Check(pieces_account.streams == 0 && pieces_account.partial == 0, "everything given back");
  return 0;
}
