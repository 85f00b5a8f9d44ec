// OipSequences: Triton's correlation ids onto sessions, as a state machine. Random operation
// sequences (fixed seeds) against a reference of what must hold after every operation: each id in
// progress steps the session its start opened; every opened session is closed exactly once (at the
// end, a new start, or a failed start) unless the store lost it; the table never holds more than
// its bound, and forgets what sat idle past the sessions' TTL.
#include "server/protocol/oip_sequences.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using Clock = OipSequences::Clock;

TEST(OipSequencesTest, AStartOpensStepsReuseAndTheEndCloses) {
  Clock::time_point now{};
  OipSequences seqs(4, std::chrono::seconds(300), [&] { return now; });
  int opened = 0;
  std::vector<std::string> closed;
  const auto open = [&]() -> StatusOr<std::string> { return "h" + std::to_string(++opened); };
  const auto close = [&](const std::string& h) { closed.push_back(h); };
  const OipSequence start{"i:7", true, false}, step{"i:7", false, false}, end{"i:7", false, true};
  auto h = seqs.Begin("m", start, open, close);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, "h1");
  seqs.Finish("m", start, *h, Status::Ok(), close);
  EXPECT_EQ(*seqs.Begin("m", step, open, close), "h1");
  EXPECT_EQ(seqs.Begin("other", step, open, close).status().code(),
            StatusCode::kNotFound);  // Per model.
  EXPECT_EQ(*seqs.Begin("m", end, open, close), "h1");
  seqs.Finish("m", end, "h1", Status::Ok(), close);
  EXPECT_THAT(closed, ::testing::ElementsAre("h1"));
  const Status gone = seqs.Begin("m", step, open, close).status();
  EXPECT_EQ(gone.code(), StatusCode::kNotFound);
  EXPECT_THAT(gone.message(), HasSubstr("sequence_id']: 7 of model 'm' is not in progress"));
  EXPECT_EQ(seqs.size(), 0u);
}

TEST(OipSequencesTest, BoundedAndIdleOnesAreForgotten) {
  Clock::time_point now{};
  OipSequences seqs(2, std::chrono::seconds(10), [&] { return now; });
  int opened = 0;
  const auto open = [&]() -> StatusOr<std::string> { return "h" + std::to_string(++opened); };
  const auto close = [](const std::string&) {};
  ASSERT_TRUE(seqs.Begin("m", {"i:1", true, false}, open, close).ok());
  ASSERT_TRUE(seqs.Begin("m", {"i:2", true, false}, open, close).ok());
  const Status full = seqs.Begin("m", {"i:3", true, false}, open, close).status();
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("--kv-max-entries"));
  now += std::chrono::seconds(5);
  ASSERT_TRUE(seqs.Begin("m", {"i:1", false, false}, open, close).ok());  // 1 used again, 2 not.
  now += std::chrono::seconds(6);
  EXPECT_TRUE(seqs.Begin("m", {"i:3", true, false}, open, close).ok());  // 2 forgotten: room.
  EXPECT_EQ(seqs.Begin("m", {"i:2", false, false}, open, close).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(seqs.size(), 2u);
}

TEST(OipSequencesTest, RandomOperationSequencesKeepEveryInvariant) {
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    std::mt19937 rng(seed);
    Clock::time_point now{};
    const size_t bound = 1 + rng() % 6;
    const auto idle = std::chrono::seconds(1 + rng() % 20);
    OipSequences seqs(bound, idle, [&] { return now; });
    int opened = 0;
    std::set<std::string> open_handles;  // Opened, not closed, not lost.
    std::set<std::string> closed;
    std::map<std::string, std::pair<std::string, Clock::time_point>> ref;  // id -> handle, last use
    const auto open = [&]() -> StatusOr<std::string> {
      if (rng() % 10 == 0) return Status(StatusCode::kInvalidArgument, "batch: bad");
      const std::string h = "h" + std::to_string(++opened);
      open_handles.insert(h);
      return h;
    };
    const auto close = [&](const std::string& h) {
      ASSERT_TRUE(closed.insert(h).second) << "closed twice: " << h;
      ASSERT_EQ(open_handles.erase(h), 1u) << "closed a handle not open: " << h;
    };
    for (int op = 0; op < 200; ++op) {
      now += std::chrono::milliseconds(rng() % 3000);
      // The reference forgets idle ones first (their sessions expired in the store).
      for (auto it = ref.begin(); it != ref.end();) {
        if (now - it->second.second >= idle) {
          open_handles.erase(it->second.first);  // The store ended it: lost, never to be closed.
          it = ref.erase(it);
        } else {
          ++it;
        }
      }
      const std::string id = "i:" + std::to_string(1 + rng() % 8);
      const OipSequence seq{id, rng() % 3 == 0, rng() % 4 == 0};
      auto h = seqs.Begin("m", seq, open, close);
      auto known = ref.find(id);
      if (seq.start) {
        if (known != ref.end()) ref.erase(known);  // Closed by the new start.
        if (!h.ok()) {
          ASSERT_TRUE(h.status().code() == StatusCode::kResourceExhausted ||
                      h.status().code() == StatusCode::kInvalidArgument)
              << h.status().ToString();
          ASSERT_TRUE(h.status().code() != StatusCode::kResourceExhausted || ref.size() >= bound);
          continue;
        }
        ref[id] = {*h, now};
      } else if (known == ref.end()) {
        ASSERT_EQ(h.status().code(), StatusCode::kNotFound) << seed << " op " << op;
        continue;
      } else {
        ASSERT_TRUE(h.ok());
        ASSERT_EQ(*h, known->second.first);
        known->second.second = now;
      }
      // The step's outcome: ok, refused, or the session gone from the store.
      const int r = rng() % 10;
      const Status result = r < 7   ? Status::Ok()
                            : r < 9 ? Status(StatusCode::kInvalidArgument, "bad")
                                    : Status(StatusCode::kNotFound, "session gone");
      if (result.code() == StatusCode::kNotFound) open_handles.erase(*h);  // Lost by the store.
      seqs.Finish("m", seq, *h, result, close);
      if (seq.end || result.code() == StatusCode::kNotFound || (seq.start && !result.ok()))
        ref.erase(id);
      ASSERT_LE(seqs.size(), bound);
      ASSERT_EQ(seqs.size(), ref.size()) << seed << " op " << op;
      // Every handle still open is one the reference maps (none leaked by the table).
      std::set<std::string> mapped;
      for (const auto& [k, v] : ref) mapped.insert(v.first);
      ASSERT_EQ(open_handles, mapped) << seed << " op " << op;
    }
  }
}

}  // namespace
}  // namespace attnserve
