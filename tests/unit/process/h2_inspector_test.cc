#include "server/process/h2_inspector.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace attnserve {
namespace {

using Bytes = std::vector<uint8_t>;
using Clock = std::chrono::steady_clock;
constexpr uint8_t kData = 0, kHeaders = 1, kRst = 3, kSettings = 4, kContinuation = 9;
constexpr uint8_t kEndStream = 1, kEndHeaders = 4, kPadded = 8;

Bytes Frame(uint8_t type, uint8_t flags, uint32_t stream, const Bytes& payload) {
  const size_t n = payload.size();
  Bytes f = {
      uint8_t(n >> 16),      uint8_t(n >> 8),       uint8_t(n),           type,           flags,
      uint8_t(stream >> 24), uint8_t(stream >> 16), uint8_t(stream >> 8), uint8_t(stream)};
  f.insert(f.end(), payload.begin(), payload.end());
  return f;
}

Bytes Preface() {
  const std::string p = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  Bytes b(p.begin(), p.end());
  const Bytes settings = Frame(kSettings, 0, 0, {});
  b.insert(b.end(), settings.begin(), settings.end());
  return b;
}

// A gRPC message's 5-byte prefix and `n` bytes of body.
Bytes Message(uint32_t n) {
  Bytes m = {0, uint8_t(n >> 24), uint8_t(n >> 16), uint8_t(n >> 8), uint8_t(n)};
  m.resize(5 + n, 0x61);
  return m;
}

Bytes Cat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const Bytes& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// The peer's and listener's accounts: what the inspector gave them, and an optional cap.
struct Account final : StreamAccount {
  int64_t streams = 0, partial = 0, max_streams = 1 << 30, max_partial = int64_t{1} << 40;
  H2Breach OpenStream() override {
    if (streams >= max_streams) return {"peer_streams", "over the peer's streams"};
    ++streams;
    return {};
  }
  void CloseStream() override { --streams; }
  H2Breach AddPartial(int64_t bytes) override {
    if (partial + bytes > max_partial) return {"peer_uploads", "over the peer's uploads"};
    partial += bytes;
    return {};
  }
  void RemovePartial(int64_t bytes) override { partial -= bytes; }
};

// Feeds `bytes` in pieces of at most `piece` (random when 0); the first breach, or none.
H2Breach Feed(H2Inspector& h2, const Bytes& bytes, size_t piece = 0, uint32_t seed = 1,
              Clock::time_point now = Clock::now()) {
  std::mt19937 rng(seed);
  for (size_t at = 0; at < bytes.size();) {
    const size_t n = std::min(bytes.size() - at, piece ? piece : 1 + rng() % 40);
    if (H2Breach b = h2.OnReceived(bytes.data() + at, n, now)) return b;
    at += n;
  }
  return {};
}

TEST(H2InspectorTest, StreamsOpenUntilTheServerEndsThemOrTheClientResetsThem) {
  Account account;
  {
    H2Inspector h2(H2Limits{}, &account);
    ASSERT_FALSE(Feed(h2, Cat({Preface(), Frame(kHeaders, kEndHeaders, 1, Bytes(20, 0)),
                               Frame(kHeaders, kEndHeaders, 3, Bytes(20, 0)),
                               Frame(kHeaders, kEndHeaders | kEndStream, 5, Bytes(20, 0))})));
    EXPECT_EQ(h2.open_streams(), 3);  // A client's END_STREAM half-closes: still open.
    EXPECT_EQ(account.streams, 3);
    const Bytes trailers = Frame(kHeaders, kEndHeaders | kEndStream, 1, Bytes(7, 0));
    h2.OnSent(trailers.data(), 4);  // Written in two pieces.
    h2.OnSent(trailers.data() + 4, trailers.size() - 4);
    EXPECT_EQ(h2.open_streams(), 2);
    ASSERT_FALSE(Feed(h2, Frame(kRst, 0, 3, {0, 0, 0, 8})));
    EXPECT_EQ(h2.open_streams(), 1);
    const Bytes reset = Frame(kRst, 0, 5, {0, 0, 0, 8});
    h2.OnSent(reset.data(), reset.size());
    EXPECT_EQ(h2.open_streams(), 0);
    ASSERT_FALSE(Feed(h2, Frame(kHeaders, kEndHeaders, 7, Bytes(20, 0))));
    EXPECT_EQ(account.streams, 1);
  }
  EXPECT_EQ(account.streams, 0);  // Given back with the connection.
}

TEST(H2InspectorTest, StreamsPastTwiceTheSettingBreakWhateverTheClientAcknowledged) {
  Account account;
  H2Limits limits;
  limits.max_concurrent_streams = 4;
  H2Inspector h2(limits, &account);
  Bytes in = Preface();
  for (uint32_t id = 1; id <= 15; id += 2) in = Cat({in, Frame(kHeaders, kEndHeaders, id, {})});
  EXPECT_FALSE(Feed(h2, in));
  const H2Breach b = Feed(h2, Frame(kHeaders, kEndHeaders, 17, {}));
  EXPECT_STREQ(b.reason, "streams");
  EXPECT_NE(b.detail.find("--max-concurrent-streams"), std::string::npos) << b.detail;
}

TEST(H2InspectorTest, ThePeersAccountCanRefuseAStream) {
  Account account;
  account.max_streams = 2;
  H2Inspector h2(H2Limits{}, &account);
  const H2Breach b =
      Feed(h2, Cat({Preface(), Frame(kHeaders, kEndHeaders, 1, {}),
                    Frame(kHeaders, kEndHeaders, 3, {}), Frame(kHeaders, kEndHeaders, 5, {})}));
  EXPECT_STREQ(b.reason, "peer_streams");
}

TEST(H2InspectorTest, AHeaderBlockIsBoundedInBytesFramesAndTime) {
  H2Limits limits;
  limits.max_header_block_bytes = 1000;
  limits.max_header_block_frames = 4;
  limits.header_timeout = std::chrono::seconds(2);
  {
    Account account;
    H2Inspector h2(limits, &account);
    // 600 + 600 bytes: refused at the second frame's header, before its payload.
    const Bytes in = Cat({Preface(), Frame(kHeaders, 0, 1, Bytes(600, 0)),
                          Frame(kContinuation, 0, 1, Bytes(600, 0))});
    const H2Breach b = Feed(h2, Bytes(in.begin(), in.end() - 600));
    EXPECT_STREQ(b.reason, "header_bytes");
  }
  {
    Account account;
    H2Inspector h2(limits, &account);
    Bytes in = Cat({Preface(), Frame(kHeaders, 0, 1, Bytes(1, 0))});
    for (int i = 0; i < 3; ++i) in = Cat({in, Frame(kContinuation, 0, 1, Bytes(1, 0))});
    EXPECT_FALSE(Feed(h2, in));  // 4 frames: the most.
    EXPECT_STREQ(Feed(h2, Frame(kContinuation, 0, 1, Bytes(1, 0))).reason, "header_frames");
  }
  {
    Account account;
    H2Inspector h2(limits, &account);
    const auto t0 = Clock::now();
    EXPECT_FALSE(Feed(h2, Cat({Preface(), Frame(kHeaders, 0, 1, Bytes(10, 0))}), 0, 1, t0));
    EXPECT_FALSE(
        Feed(h2, Frame(kContinuation, 0, 1, Bytes(1, 0)), 0, 1, t0 + std::chrono::seconds(1)));
    const H2Breach late = Feed(h2, Frame(kContinuation, kEndHeaders, 1, Bytes(1, 0)), 0, 1,
                               t0 + std::chrono::seconds(3));
    EXPECT_STREQ(late.reason, "header_timeout");
  }
  {
    Account account;  // A whole block ends the clock: a later block starts its own.
    H2Inspector h2(limits, &account);
    const auto t0 = Clock::now();
    EXPECT_FALSE(
        Feed(h2, Cat({Preface(), Frame(kHeaders, kEndHeaders, 1, Bytes(10, 0))}), 0, 1, t0));
    EXPECT_FALSE(Feed(h2, Frame(kHeaders, kEndHeaders, 3, Bytes(10, 0)), 0, 1,
                      t0 + std::chrono::seconds(30)));
  }
}

TEST(H2InspectorTest, IncompleteMessagesAreCountedUntilWholeAndTooBigOnesBreakAtTheirPrefix) {
  Account account;
  H2Limits limits;
  limits.max_message_bytes = 1 << 20;
  H2Inspector h2(limits, &account);
  const Bytes message = Message(100000);
  // Two streams; stream 1's message split over frames, one of them padded.
  Bytes padded = {9};
  padded.insert(padded.end(), message.begin(), message.begin() + 1000);
  padded.resize(padded.size() + 9, 0);
  ASSERT_FALSE(
      Feed(h2, Cat({Preface(), Frame(kHeaders, kEndHeaders, 1, {}),
                    Frame(kHeaders, kEndHeaders, 3, {}), Frame(kData, kPadded, 1, padded),
                    Frame(kData, 0, 1, Bytes(message.begin() + 1000, message.begin() + 50000))})));
  EXPECT_EQ(h2.partial_bytes(), 50000);
  EXPECT_EQ(account.partial, 50000);
  ASSERT_FALSE(
      Feed(h2, Frame(kData, kEndStream, 1, Bytes(message.begin() + 50000, message.end()))));
  EXPECT_EQ(h2.partial_bytes(), 0);  // Whole: the request's budget counts it from here.
  ASSERT_FALSE(Feed(h2, Frame(kData, 0, 3, Bytes(message.begin(), message.begin() + 777))));
  EXPECT_EQ(account.partial, 777);
  const Bytes closed = Frame(kRst, 0, 3, {0, 0, 0, 0});
  h2.OnSent(closed.data(), closed.size());
  EXPECT_EQ(account.partial, 0);  // Its stream ended: nothing of it is held.
  ASSERT_FALSE(Feed(h2, Frame(kHeaders, kEndHeaders, 5, {})));
  const H2Breach big = Feed(h2, Frame(kData, 0, 5, Bytes{0, 0, 0x20, 0, 0}));  // 2 MiB announced.
  EXPECT_STREQ(big.reason, "message_bytes");
  EXPECT_NE(big.detail.find("2097152"), std::string::npos) << big.detail;
}

TEST(H2InspectorTest, ThePeersAccountCanRefuseUploadBytes) {
  Account account;
  account.max_partial = 5000;
  H2Inspector h2(H2Limits{}, &account);
  const Bytes message = Message(100000);
  const H2Breach b =
      Feed(h2, Cat({Preface(), Frame(kHeaders, kEndHeaders, 1, {}),
                    Frame(kData, 0, 1, Bytes(message.begin(), message.begin() + 8000))}));
  EXPECT_STREQ(b.reason, "peer_uploads");
}

TEST(H2InspectorTest, ResetsPastTheRateOfMostStreamsOpenedBreakAndTimeoutsDoNot) {
  H2Limits limits;
  limits.resets_per_second = 10;
  auto t = Clock::now();
  {
    // A client whose calls time out: 100 calls a second, 15 of them reset, for 5 s.
    Account account;
    H2Inspector h2(limits, &account);
    ASSERT_FALSE(Feed(h2, Preface(), 0, 1, t));
    uint32_t id = 1;
    for (int i = 0; i < 500; ++i, id += 2, t += std::chrono::milliseconds(10)) {
      Bytes in = Frame(kHeaders, kEndHeaders, id, {});
      if (i % 100 < 15) in = Cat({in, Frame(kRst, 0, id, {0, 0, 0, 8})});
      ASSERT_FALSE(Feed(h2, in, 0, 1, t)) << i;
      const Bytes answered =
          Frame(kHeaders, kEndHeaders | kEndStream, id, {});  // The rest answered.
      h2.OnSent(answered.data(), answered.size());
    }
  }
  {
    // Rapid reset: each stream reset as it is opened. 11 in a second break when the second ends;
    // at once, the 101st.
    Account account;
    H2Inspector h2(limits, &account);
    ASSERT_FALSE(Feed(h2, Preface(), 0, 1, t));
    uint32_t id = 1;
    const auto rapid = [&](auto when) {
      const H2Breach b =
          Feed(h2, Cat({Frame(kHeaders, kEndHeaders, id, {}), Frame(kRst, 0, id, {0, 0, 0, 8})}), 0,
               1, when);
      id += 2;
      return b;
    };
    for (int i = 0; i < 11; ++i) ASSERT_FALSE(rapid(t)) << i;
    EXPECT_STREQ(rapid(t + std::chrono::milliseconds(1001)).reason, "resets");
    Account other;
    H2Inspector burst(limits, &other);
    ASSERT_FALSE(Feed(burst, Preface(), 0, 1, t));
    H2Breach b;
    int n = 0;
    for (id = 1; n < 200 && !b; ++n, id += 2) {
      b = Feed(burst, Cat({Frame(kHeaders, kEndHeaders, id, {}), Frame(kRst, 0, id, {0, 0, 0, 8})}),
               0, 1, t);
    }
    EXPECT_STREQ(b.reason, "resets");
    EXPECT_EQ(n, 101);
  }
}

TEST(H2InspectorTest, SettingsFramesPastTheirRateBreak) {
  H2Limits limits;
  limits.settings_per_second = 5;
  limits.settings_burst = 20;
  auto t = Clock::now();
  Account account;
  H2Inspector h2(limits, &account);
  ASSERT_FALSE(Feed(h2, Preface(), 0, 1, t));  // Its SETTINGS: the first of the bucket.
  for (int i = 0; i < 100; ++i, t += std::chrono::milliseconds(250)) {
    ASSERT_FALSE(Feed(h2, Frame(kSettings, 0, 0, {}), 0, 1, t)) << i;  // 4 a second.
    ASSERT_FALSE(Feed(h2, Frame(kSettings, 1, 0, {}), 0, 1, t)) << i;  // Acknowledgements: free.
  }
  H2Breach b;
  int n = 0;
  for (; n < 40 && !b; ++n) b = Feed(h2, Frame(kSettings, 0, 0, {}), 0, 1, t);
  EXPECT_STREQ(b.reason, "settings");
  EXPECT_LE(n, 21);
}

TEST(H2InspectorTest, NotHttp2IsLeftToGrpc) {
  Account account;
  H2Inspector h2(H2Limits{}, &account);
  const std::string http1 = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  EXPECT_FALSE(
      h2.OnReceived(reinterpret_cast<const uint8_t*>(http1.data()), http1.size(), Clock::now()));
  EXPECT_FALSE(Feed(h2, Frame(kHeaders, kEndHeaders, 1, {})));
  EXPECT_EQ(account.streams, 0);
}

// The same bytes in any pieces: the same counts and the same verdict (fresh random streams of
// frames, fixed seeds).
TEST(H2InspectorTest, PiecesDoNotChangeWhatIsCounted) {
  for (uint32_t seed = 1; seed <= 200; ++seed) {
    std::mt19937 rng(seed);
    Bytes in = Preface(), out;
    uint32_t next = 1;
    std::vector<uint32_t> opened;
    for (int step = 0; step < 60; ++step) {
      switch (rng() % 5) {
        case 0:
          in = Cat({in, Frame(kHeaders, kEndHeaders, next, Bytes(rng() % 50, 0))});
          opened.push_back(next);
          next += 2;
          break;
        case 1:
          if (!opened.empty()) {
            const uint32_t id = opened[rng() % opened.size()];
            const Bytes m = Message(rng() % 3000);
            const size_t cut = rng() % (m.size() + 1);
            in = Cat({in, Frame(kData, 0, id, Bytes(m.begin(), m.begin() + cut))});
          }
          break;
        case 2:
          if (!opened.empty())
            out = Cat({out, Frame(kHeaders, kEndStream | kEndHeaders, opened[rng() % opened.size()],
                                  {})});
          break;
        case 3:
          if (!opened.empty())
            in = Cat({in, Frame(kRst, 0, opened[rng() % opened.size()], {0, 0, 0, 8})});
          break;
        default:
          in = Cat({in, Frame(kSettings, 1, 0, {})});
      }
    }
    Account whole_account, pieces_account;
    H2Inspector whole(H2Limits{}, &whole_account), pieces(H2Limits{}, &pieces_account);
    const H2Breach a = Feed(whole, in, in.size());
    const H2Breach b = Feed(pieces, in, 0, seed);
    whole.OnSent(out.data(), out.size());
    for (size_t at = 0; at < out.size(); at += 7)
      pieces.OnSent(out.data() + at, std::min<size_t>(7, out.size() - at));
    ASSERT_EQ(bool(a), bool(b)) << seed;
    EXPECT_EQ(whole.open_streams(), pieces.open_streams()) << seed;
    EXPECT_EQ(whole.partial_bytes(), pieces.partial_bytes()) << seed;
    EXPECT_EQ(whole_account.streams, whole.open_streams()) << seed;
    EXPECT_EQ(whole_account.partial, whole.partial_bytes()) << seed;
    EXPECT_GE(whole.partial_bytes(), 0) << seed;
  }
}

}  // namespace
}  // namespace attnserve
