// The staging budget: blocks count while alive, a block past the budget is refused (never an
// error), blocks outliving their HostStaging still give their bytes back, and the count stays
// exact under threads. Plain memory here (pinned memory needs a GPU); the accounting is the same.
#include "server/engine/host_staging.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

namespace attnserve {
namespace {

TEST(HostStagingTest, BlocksCountWhileAliveAndThoseOverTheBudgetAreRefused) {
  HostStaging staging(1000, /*pinned=*/false);
  char* a = nullptr;
  char* b = nullptr;
  char* c = nullptr;
  std::shared_ptr<void> first = staging.Allocate(600, &a);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  std::memset(a, 7, 600);                         // Usable memory.
  EXPECT_EQ(staging.held_bytes(), 640);           // Rounded to 64 bytes.
  EXPECT_EQ(staging.Allocate(400, &b), nullptr);  // 640 + 448 > 1000.
  EXPECT_EQ(b, nullptr);
  EXPECT_EQ(staging.refused(), 1);
  std::shared_ptr<void> second = staging.Allocate(300, &b);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(staging.held_bytes(), 960);
  first.reset();
  EXPECT_EQ(staging.held_bytes(), 320);
  std::shared_ptr<void> third = staging.Allocate(600, &c);
  EXPECT_NE(third, nullptr);
  EXPECT_EQ(staging.Allocate(2000, &c), nullptr);  // Larger than the whole budget.
  EXPECT_EQ(staging.Allocate(0, &c), nullptr);     // Nothing to stage.
  EXPECT_EQ(staging.refused(), 2);
}

TEST(HostStagingTest, NoBudgetRefusesEverything) {
  HostStaging staging(0, false);
  char* p = nullptr;
  EXPECT_EQ(staging.Allocate(1, &p), nullptr);
  EXPECT_EQ(staging.held_bytes(), 0);
}

TEST(HostStagingTest, ABlockMayOutliveItsStaging) {
  std::shared_ptr<void> block;
  {
    HostStaging staging(4096, false);
    char* p = nullptr;
    block = staging.Allocate(100, &p);
    ASSERT_NE(block, nullptr);
  }
  block.reset();  // Gives back to counts the block shares: no use of the gone HostStaging.
}

TEST(HostStagingTest, TheHeldCountStaysExactUnderThreads) {
  HostStaging staging(64 * 1000, false);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&staging, t] {
      std::vector<std::shared_ptr<void>> mine;
      for (int i = 0; i < 2000; ++i) {
        char* p = nullptr;
        if (auto b = staging.Allocate(static_cast<size_t>(1 + (i * 37 + t) % 500), &p)) {
          EXPECT_LE(staging.held_bytes(), staging.budget_bytes());
          mine.push_back(std::move(b));
        }
        if (mine.size() > 20) mine.erase(mine.begin(), mine.begin() + 10);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(staging.held_bytes(), 0);
}

}  // namespace
}  // namespace attnserve
