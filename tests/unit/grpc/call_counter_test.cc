// The count of calls open that a stop waits for and cuts.
#include "server/grpc/call_counter.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace attnserve {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

TEST(CallCounterTest, CountsCallsBetweenBeginAndEnd) {
  CallCounter calls;
  EXPECT_EQ(calls.open(), 0);
  calls.Begin();
  calls.Begin();
  EXPECT_EQ(calls.open(), 2);
  calls.End(/*cancelled=*/false);
  calls.End(/*cancelled=*/true);  // A client's cancel before any stop cuts nothing.
  EXPECT_EQ(calls.open(), 0);
  EXPECT_EQ(calls.cut(), 0);
}

TEST(CallCounterTest, WaitNoneReturnsWhenTheLastCallEnds) {
  CallCounter calls;
  EXPECT_TRUE(calls.WaitNone(steady_clock::now()));
  calls.Begin();
  EXPECT_FALSE(calls.WaitNone(steady_clock::now() + milliseconds(20)));
  std::thread ender([&] {
    std::this_thread::sleep_for(milliseconds(30));
    calls.End(false);
  });
  const auto start = steady_clock::now();
  EXPECT_TRUE(calls.WaitNone(start + milliseconds(10000)));
  EXPECT_LT(steady_clock::now() - start, milliseconds(5000));
  ender.join();
}

TEST(CallCounterTest, WaitNoneWaitsOutTheQuietPeriodAfterTheLastCallBegan) {
  CallCounter calls;
  calls.Begin();
  calls.End(false);
  const auto start = steady_clock::now();
  EXPECT_FALSE(calls.WaitNone(start + milliseconds(20), milliseconds(2000)));  // Too soon.
  EXPECT_LT(steady_clock::now() - start, milliseconds(1500));
  EXPECT_TRUE(calls.WaitNone(start + milliseconds(10000), milliseconds(100)));
  EXPECT_GE(steady_clock::now() - start, milliseconds(100));
  EXPECT_TRUE(calls.WaitNone(steady_clock::now(), milliseconds(100)));  // Quiet already.
}

TEST(CallCounterTest, CutCountsCallsThatEndCancelledAfterTheCutAndThoseStillOpen) {
  CallCounter calls;
  for (int i = 0; i < 5; ++i) calls.Begin();
  calls.End(/*cancelled=*/true);  // Before the cut: the client's own doing.
  EXPECT_EQ(calls.cut(), 4);      // An exit now would cut the four open.
  calls.BeginCut();
  calls.End(/*cancelled=*/true);   // Cut.
  calls.End(/*cancelled=*/false);  // Its answer went out whole before the cancel reached it.
  EXPECT_EQ(calls.open(), 2);
  EXPECT_EQ(calls.cut(), 3);  // One ended cut, two still open.
  calls.End(true);
  calls.End(true);
  EXPECT_EQ(calls.open(), 0);
  EXPECT_EQ(calls.cut(), 3);
}

TEST(CallCounterTest, ManyThreadsBalance) {
  CallCounter calls;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        calls.Begin();
        calls.End(i % 3 == 0);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls.open(), 0);
  EXPECT_EQ(calls.cut(), 0);
}

}  // namespace
}  // namespace attnserve
