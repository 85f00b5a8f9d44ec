// PackingPlan alone (no LibTorch): the row order and offsets a batch's packed matrices use, and the
// runs one varlen attention launch serves. Checked on fixed cases and, as invariants, on random
// batches (fixed seed).
#include "server/core/packing_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

namespace attnserve {
namespace {

using ::testing::ElementsAre;

AttendCall Self(int64_t batch, int64_t len, bool causal = false) {
  AttendCall c;
  c.batch = batch;
  c.query_len = c.key_len = len;
  c.is_causal = causal;
  return c;
}

AttendCall Cross(int64_t batch, int64_t lq, int64_t lk) {
  AttendCall c = Self(batch, lq);
  c.key_len = lk;
  c.key = TensorView{};
  c.value = TensorView{};
  return c;
}

std::vector<const AttendCall*> Pointers(const std::vector<AttendCall>& calls) {
  std::vector<const AttendCall*> p;
  for (const AttendCall& c : calls) p.push_back(&c);
  return p;
}

TEST(PackingPlanTest, SelfAttentionRowsComeFirstThenCrossEachGroupInArrivalOrder) {
  std::vector<AttendCall> calls = {Cross(1, 3, 5), Self(2, 4), Self(1, 7, /*causal=*/true),
                                   Self(1, 2), Cross(2, 1, 6)};
  const PackingPlan plan = PlanPacking(Pointers(calls), /*varlen=*/false, 0);
  EXPECT_THAT(plan.order, ElementsAre(1, 3, 2, 0, 4));
  EXPECT_THAT(plan.q_offset, ElementsAre(17, 0, 10, 8, 20));
  EXPECT_EQ(plan.self_rows, 17);  // 8 + 2 + 7
  EXPECT_EQ(plan.q_rows, 22);
  EXPECT_EQ(plan.k_rows, 17);  // 5 + 2 * 6: only keys on the wire
  EXPECT_EQ(plan.k_offset[0], 0);
  EXPECT_EQ(plan.k_offset[4], 5);
  EXPECT_TRUE(plan.varlen_runs.empty());
}

TEST(PackingPlanTest, EligibleCallsOfAGroupFormOneRunAheadOfTheRest) {
  std::vector<AttendCall> calls = {Self(1, 4), Self(1, 5),       Self(1, 6),
                                   Self(1, 7), Self(1, 8, true), Self(1, 9, true)};
  calls[1].weights = WeightsMode::kAveraged;  // Not eligible: it must attend alone.
  const PackingPlan plan = PlanPacking(Pointers(calls), /*varlen=*/true, 0);
  EXPECT_THAT(plan.order, ElementsAre(0, 2, 3, 1, 4, 5));
  ASSERT_EQ(plan.varlen_runs.size(), 2u);
  EXPECT_THAT(plan.varlen_runs[0], ElementsAre(0, 2, 3));
  EXPECT_THAT(plan.varlen_runs[1], ElementsAre(4, 5));
  // A model that appends keys (bias_k, zero attention) has no eligible call.
  EXPECT_TRUE(PlanPacking(Pointers(calls), true, 1).varlen_runs.empty());
}

TEST(PackingPlanTest, EligibilityNeedsContiguousRowsAndNothingBesidesTheKeys) {
  AttendCall c = Self(2, 4);
  EXPECT_TRUE(VarlenEligible(c, 0));
  c.layout = TensorLayout::kSequenceFirst;
  EXPECT_FALSE(VarlenEligible(c, 0));  // Batch elements interleave row by row.
  c.batch = 1;
  EXPECT_TRUE(VarlenEligible(c, 0));
  c.kv_use = AttendCall::Kv::kSession;
  EXPECT_FALSE(VarlenEligible(c, 0));
  c = Self(1, 4);
  c.attn_mask = TensorView{};
  EXPECT_FALSE(VarlenEligible(c, 0));
}

// Invariants on random batches: the order is a permutation grouped self-then-cross and
// non-causal-then-causal; every call's query rows tile [0, q_rows) without overlap in that order,
// self-attention's first; wire keys tile [0, k_rows); every run is ≥ 2 consecutive eligible calls
// of one group.
TEST(PackingPlanTest, RandomBatchesTileTheRowsInGroupOrder) {
  std::mt19937 rng(20261124);
  std::uniform_int_distribution<int> len(1, 40), count(1, 12), kind(0, 5);
  for (int round = 0; round < 500; ++round) {
    std::vector<AttendCall> calls;
    const int n = count(rng);
    for (int i = 0; i < n; ++i) {
      const int k = kind(rng);
      AttendCall c = k < 2   ? Self(1 + k, len(rng), false)
                     : k < 4 ? Self(1, len(rng), true)
                             : Cross(1 + (k & 1), len(rng), len(rng));
      if (k == 3) c.weights = WeightsMode::kPerHead;
      if (k == 5) c.is_causal = true;
      calls.push_back(c);
    }
    const bool varlen = round % 2 == 0;
    const PackingPlan plan = PlanPacking(Pointers(calls), varlen, 0);
    ASSERT_EQ(plan.order.size(), calls.size());
    std::vector<int> seen(calls.size(), 0);
    int64_t q = 0, k = 0, self = 0, last_group = -1;
    for (size_t i : plan.order) {
      ++seen.at(i);
      const AttendCall& c = calls[i];
      const int group = (c.self_attention() ? 0 : 2) + (c.is_causal ? 1 : 0);
      ASSERT_GE(group, last_group);
      last_group = group;
      ASSERT_EQ(plan.q_offset[i], q);
      q += c.batch * c.query_len;
      if (c.self_attention()) {
        ASSERT_EQ(plan.q_offset[i], self) << "self-attention rows come first";
        self = q;
      }
      if (c.key) {
        ASSERT_EQ(plan.k_offset[i], k);
        k += c.batch * c.key_len;
      }
    }
    ASSERT_THAT(seen, ::testing::Each(1));
    ASSERT_EQ(plan.q_rows, q);
    ASSERT_EQ(plan.self_rows, self);
    ASSERT_EQ(plan.k_rows, k);
    for (const auto& run : plan.varlen_runs) {
      ASSERT_TRUE(varlen);
      ASSERT_GE(run.size(), 2u);
      for (size_t j = 0; j < run.size(); ++j) {
        ASSERT_TRUE(VarlenEligible(calls[run[j]], 0));
        if (j > 0)
          ASSERT_EQ(
              plan.q_offset[run[j]],
              plan.q_offset[run[j - 1]] + calls[run[j - 1]].batch * calls[run[j - 1]].query_len);
        ASSERT_EQ(calls[run[j]].is_causal, calls[run[0]].is_causal);
        ASSERT_EQ(calls[run[j]].self_attention(), calls[run[0]].self_attention());
      }
    }
  }
}

}  // namespace
}  // namespace attnserve
