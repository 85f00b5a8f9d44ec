// What a stream request whose answer cannot be delivered is counted as: the client's deadline
// (which reaches the server as a cancellation, possibly before the server's copy of it passes) or
// the client's own cancellation.
#include <gtest/gtest.h>

#include <chrono>

#include "server/grpc/stream_reactor.h"

namespace attnserve {
namespace {

using std::chrono::milliseconds;

TEST(StreamOutcomeTest, TheDeadlineWhenItPassedOrIsDueElseTheClientsCancellation) {
  const auto now = SteadyClock::now();
  EXPECT_EQ(StreamReactor::UndeliveredBy(now - milliseconds(1)).code(),
            StatusCode::kDeadlineExceeded);
  EXPECT_EQ(StreamReactor::UndeliveredBy(now + milliseconds(50)).code(),
            StatusCode::kDeadlineExceeded);
  EXPECT_EQ(StreamReactor::UndeliveredBy(now + std::chrono::seconds(10)).code(),
            StatusCode::kCancelled);
  EXPECT_EQ(StreamReactor::UndeliveredBy(SteadyClock::time_point::max()).code(),
            StatusCode::kCancelled);
}

}  // namespace
}  // namespace attnserve
