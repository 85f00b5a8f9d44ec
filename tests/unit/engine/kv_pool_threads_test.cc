// A KvPool shared by threads (each model's workers allocate and release sessions' slots at once):
// every thread marks the rows of its live slots and finds them untouched by the others until it
// lets them go; at the end no chunk is held. ThreadSanitizer runs it (tools/sanitize.sh).
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "server/engine/torch_kv.h"

namespace attnserve {
namespace {

TEST(KvPoolThreadsTest, ConcurrentSlotsNeverShareARow) {
  auto pool = std::make_shared<KvPool>(1, 1, at::TensorOptions().dtype(at::kFloat), 256);
  std::vector<std::thread> threads;
  std::vector<int> overlaps(4, 0);
  for (int id = 0; id < 4; ++id) {
    threads.emplace_back([&, id] {
      std::mt19937 rng(static_cast<uint32_t>(id));
      std::vector<std::unique_ptr<KvPool::Slot>> live;
      const auto rows_of = [](const KvPool::Slot& s) {
        return s.chunk()->k.narrow(0, s.start(), s.rows()).view({-1});
      };
      for (int op = 0; op < 3000; ++op) {
        if (live.size() < 8 && rng() % 2 == 0) {
          live.push_back(pool->Allocate(1 + static_cast<int64_t>(rng() % 80)));
          rows_of(*live.back()).fill_(static_cast<float>(id));
        } else if (!live.empty()) {
          const size_t at = rng() % live.size();
          overlaps[id] += !rows_of(*live[at]).eq(static_cast<float>(id)).all().item<bool>();
          live.erase(live.begin() + static_cast<int64_t>(at));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int id = 0; id < 4; ++id) EXPECT_EQ(overlaps[id], 0) << "thread " << id;
  EXPECT_EQ(pool->usage().chunks, 0);
  EXPECT_EQ(pool->usage().used, 0);
}

}  // namespace
}  // namespace attnserve
