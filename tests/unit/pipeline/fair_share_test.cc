// Tenants and priorities in the batch queue, driven deterministically (no threads, no clocks):
// the Virtual Token Counter's lift rule and service-gap bound, work conservation, strict priority
// levels with Triton's queue policies, and the bounds that refuse.
#include "server/pipeline/fair_share.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "server/pipeline/batcher.h"

namespace attnserve {
namespace {

using namespace std::chrono_literals;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class NullModel : public AttentionModel {
 public:
  NullModel() { spec_.name = "null"; }
  const ModelSpec& spec() const override { return spec_; }
  Status Forward(const AttendCall&, AttendOutputs*) const override { return Status::Ok(); }
  ModelSpec spec_;
};

const SteadyClock::time_point kT0 = SteadyClock::time_point(1000s);

class FairQueueTest : public ::testing::Test {
 protected:
  FairQueueTest() {
    options_.max_batch_tokens = 100;
    options_.max_shared_request_tokens = 100;
    options_.max_queue_size = 1000;
  }
  // A request of `tenant`, `tokens` tokens, costing `flops`; id = query_len (unique per test).
  std::unique_ptr<WorkItem> Item(const std::string& tenant, int64_t id, int64_t tokens,
                                 double flops, int64_t level = 0, double weight = 1) {
    auto item = std::make_unique<WorkItem>();
    item->model = std::shared_ptr<const AttentionModel>(&model_, [](const AttentionModel*) {});
    item->accepted = kT0 + std::chrono::microseconds(id);
    item->call.batch = 1;
    item->call.query_len = id;
    item->call.tokens = tokens;
    item->call.attention_cost = 1;
    item->tenant = tenant;
    item->weight = weight;
    item->flops = flops;
    item->level = level;
    item->done = [](const Status&, const WorkItem&) {};
    return item;
  }
  Status Add(BatchQueue& q, std::unique_ptr<WorkItem> item, const char** reason = nullptr) {
    Status refused;
    const char* r = "";
    auto back = q.Add(std::move(item), kT0, &dropped_, &refused, &r);
    if (reason) *reason = r;
    EXPECT_EQ(back == nullptr, refused.ok());
    return refused;
  }
  static std::vector<int64_t> Ids(const std::vector<std::unique_ptr<WorkItem>>& batch) {
    std::vector<int64_t> ids;
    for (const auto& i : batch) ids.push_back(i->call.query_len);
    return ids;
  }

  NullModel model_;
  BatcherOptions options_;
  FairShare share_;
  Dropped dropped_;
};

TEST(FairShareTest, ATenantBackFromIdleIsLiftedToTheSmallestWaitingCounter) {
  FairShare s;
  s.Arrive("a");
  s.Charge("a", 100, 1);
  s.Leave("a");   // a idle at 100.
  s.Arrive("b");  // Nobody waits: lifted to the last one served.
  EXPECT_EQ(s.Counter("b"), 100);
  s.Charge("b", 50, 1);  // b at 150, still waiting (not left).
  s.Arrive("c");         // Lifted to the smallest waiting counter: b's.
  EXPECT_EQ(s.Counter("c"), 150);
  s.Arrive("a");  // a (100) comes back below the waiting ones: lifted, no credit for idling.
  EXPECT_EQ(s.Counter("a"), 150);
  s.Charge("a", 1000, 4);  // Weight 4: a quarter counts.
  EXPECT_EQ(s.Counter("a"), 400);
  s.Arrive("a");  // Already waiting: not lifted again.
  EXPECT_EQ(s.Queued("a"), 2);
  EXPECT_EQ(s.Counter("a"), 400);
}

TEST(FairShareTest, RemembersABoundedNumberOfIdleTenants) {
  FairShare s;
  s.Arrive("busy");
  // Past the bound by a quarter of it: every arrival then forgets one idle tenant. (Three times the
  // bound took 9 s here and 72 s under ThreadSanitizer: forgetting scans the idle ones.)
  for (int i = 0; i < static_cast<int>(FairShare::kRemembered + FairShare::kRemembered / 4); ++i) {
    const std::string t = "t" + std::to_string(i);
    s.Arrive(t);
    s.Charge(t, 1 + i, 1);  // Each idles above the waiting one's counter.
    s.Leave(t);
    ASSERT_LE(s.size(), FairShare::kRemembered + 1);
  }
  EXPECT_EQ(s.Queued("busy"), 1);  // The waiting tenant is never forgotten.
}

TEST_F(FairQueueTest, TheTenantServedLeastLeadsAndFillsFirst) {
  BatchQueue q(options_, {}, &share_);
  for (int i = 1; i <= 6; ++i) ASSERT_TRUE(Add(q, Item("heavy", i, 30, 300)).ok());
  ASSERT_TRUE(Add(q, Item("light", 7, 10, 100)).ok());
  // Both at 0 (light was lifted to heavy's 0): the tie goes to the tenant with fewer waiting, so
  // light's request leads though heavy's are older; the batch then fills tenant by tenant by
  // counter (light at 100 has nothing more): heavy's three oldest.
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(7, 1, 2, 3));
  EXPECT_EQ(share_.Counter("heavy"), 900);
  EXPECT_EQ(share_.Counter("light"), 100);
  ASSERT_TRUE(Add(q, Item("light", 8, 10, 100)).ok());
  // light came back from idle: lifted to heavy's 900 (no credit for idling), and leads the tie.
  EXPECT_EQ(share_.Counter("light"), 900);
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(8, 4, 5, 6));
  // Both idle, then back: heavy at its 1800 (the last served), light lifted to it; equal counters
  // and equal waiting: the older request leads.
  ASSERT_TRUE(Add(q, Item("heavy", 9, 30, 300)).ok());
  ASSERT_TRUE(Add(q, Item("light", 10, 10, 100)).ok());
  EXPECT_EQ(share_.Counter("heavy"), 1800);
  EXPECT_EQ(share_.Counter("light"), 1800);
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_, 1)), ElementsAre(9));
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_, 1)), ElementsAre(10));
}

TEST_F(FairQueueTest, FcfsTakesArrivalOrderWhoeverAsks) {
  options_.scheduling = BatcherOptions::Scheduling::kFcfs;
  BatchQueue q(options_, {}, &share_);
  for (int i = 1; i <= 4; ++i) ASSERT_TRUE(Add(q, Item("heavy", i, 30, 300)).ok());
  ASSERT_TRUE(Add(q, Item("light", 5, 10, 100)).ok());
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(1, 2, 3, 5));
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(4));
}

// Two tenants kept backlogged with random request sizes and weights 1:1 and 3:1: their weighted
// counters never drift apart by more than two of the largest batch's weighted cost (VTC's bound),
// the served work follows the weights within 10%, and no Take comes back empty while work waits.
TEST_F(FairQueueTest, BackloggedTenantsShareByWeightWithinTheGapBound) {
  for (double wb : {1.0, 3.0}) {
    for (uint32_t seed : {1u, 2u, 3u}) {
      FairShare share;
      BatchQueue q(options_, {}, &share);
      std::mt19937 rng(seed);
      std::uniform_int_distribution<int64_t> tokens(1, 100);
      std::map<std::string, double> served, weight{{"a", 1.0}, {"b", wb}};
      std::map<std::string, int> queued{{"a", 0}, {"b", 0}};
      int64_t id = 0;
      double largest = 0;
      for (int round = 0; round < 3000; ++round) {
        for (const auto& [t, w] : weight) {
          while (queued[t] < 8) {
            const int64_t n = tokens(rng);
            ASSERT_TRUE(Add(q, Item(t, ++id, n, static_cast<double>(n * n), 0, w)).ok());
            ++queued[t];
          }
        }
        auto batch = q.Take(kT0, &dropped_, 1 + round % 4);
        ASSERT_FALSE(batch.empty()) << "work waits, nothing taken";
        double cost = 0;
        for (const auto& item : batch) {
          served[item->tenant] += item->flops;
          --queued[item->tenant];
          cost += item->flops / item->weight;
        }
        largest = std::max(largest, cost);
        ASSERT_LE(std::abs(share.Counter("a") - share.Counter("b")), 2 * largest)
            << "seed " << seed << " round " << round;
      }
      const double ratio = (served["b"] / wb) / served["a"];
      EXPECT_NEAR(ratio, 1.0, 0.1) << "weights 1:" << wb << " seed " << seed;
    }
  }
}

TEST_F(FairQueueTest, ALoneTenantGetsFullBatchesAsBefore) {
  BatchQueue q(options_, {}, &share_);
  for (int i = 1; i <= 7; ++i) ASSERT_TRUE(Add(q, Item("only", i, 30, 1)).ok());
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(1, 2, 3));
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(4, 5, 6));
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(7));
}

TEST_F(FairQueueTest, AHigherLevelLeadsAndABatchHoldsOneLevel) {
  PriorityOptions p;
  p.levels = 3;
  BatchQueue q(options_, p, &share_);
  ASSERT_TRUE(Add(q, Item("a", 1, 10, 1, 3)).ok());
  ASSERT_TRUE(Add(q, Item("a", 2, 10, 1, 2)).ok());
  ASSERT_TRUE(Add(q, Item("b", 3, 10, 1, 1)).ok());
  ASSERT_TRUE(Add(q, Item("a", 4, 10, 1, 3)).ok());
  ASSERT_TRUE(Add(q, Item("a", 5, 10, 1, 1)).ok());
  EXPECT_EQ(q.rank().level, 1);
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(3, 5));
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(2));
  EXPECT_THAT(Ids(q.Take(kT0, &dropped_)), ElementsAre(1, 4));
}

TEST_F(FairQueueTest, BoundsRefuseNamingWhatIsFull) {
  PriorityOptions p;
  p.levels = 2;
  p.level_policies[1].max_queue_size = 2;
  BatchQueue q(options_, p, &share_);
  const char* reason = "";
  ASSERT_TRUE(Add(q, Item("a", 1, 10, 1, 1)).ok());
  ASSERT_TRUE(Add(q, Item("a", 2, 10, 1, 1)).ok());
  Status st = Add(q, Item("a", 3, 10, 1, 1), &reason);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("priority level 1"));
  EXPECT_STREQ(reason, "priority_queue_full");
  ASSERT_TRUE(Add(q, Item("a", 4, 10, 1, 2)).ok());  // Level 2 has no bound of its own.
  auto capped = Item("b", 5, 10, 1, 2);
  capped->tenant_max_queued = 1;
  capped->tenant_queue_cap = true;
  ASSERT_TRUE(Add(q, std::move(capped)).ok());
  capped = Item("b", 6, 10, 1, 2);
  capped->tenant_max_queued = 1;
  capped->tenant_queue_cap = true;
  st = Add(q, std::move(capped), &reason);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("tenant 'b' has 1 requests waiting"));
  EXPECT_STREQ(reason, "tenant_queue_full");
  EXPECT_EQ(share_.Queued("b"), 1);  // A refusal is not counted as waiting.
  // A caller's bound that is not its tenant's (--max-queued-per-caller) names that flag.
  auto peer = Item("default@10.0.0.1", 7, 10, 1, 2);
  peer->tenant_max_queued = 1;
  ASSERT_TRUE(Add(q, std::move(peer)).ok());
  peer = Item("default@10.0.0.1", 8, 10, 1, 2);
  peer->tenant_max_queued = 1;
  st = Add(q, std::move(peer), &reason);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("caller 'default@10.0.0.1' has 1 requests waiting"));
  EXPECT_THAT(st.message(), HasSubstr("--max-queued-per-caller 1"));
  EXPECT_STREQ(reason, "caller_queue_full");
}

TEST_F(FairQueueTest, AFullQueueMakesRoomByRefusingTheNewestOfTheCallerHoldingTheMost) {
  options_.max_queue_size = 3;
  BatchQueue q(options_, PriorityOptions{}, &share_);
  for (int64_t id = 1; id <= 3; ++id) ASSERT_TRUE(Add(q, Item("greedy", id, 10, 1, 0)).ok());
  const char* reason = "";
  ASSERT_TRUE(Add(q, Item("other", 4, 10, 1, 0), &reason).ok());  // Takes greedy's newest place.
  ASSERT_EQ(dropped_.size(), 1u);
  EXPECT_EQ(dropped_[0].first->call.query_len, 3);
  EXPECT_EQ(dropped_[0].second.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(dropped_[0].second.message(), HasSubstr("caller 'greedy' held 3"));
  EXPECT_THAT(dropped_[0].second.message(), HasSubstr("made room for another caller's"));
  EXPECT_EQ(share_.Queued("greedy"), 2);
  // 2 against 1: another of other's would leave them even, so it is refused itself.
  const Status st = Add(q, Item("other", 5, 10, 1, 0), &reason);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_STREQ(reason, "queue_full");
  EXPECT_EQ(dropped_.size(), 1u);
  // A lone caller fills an idle queue whole: nobody to make room for.
  BatchQueue alone(options_, PriorityOptions{}, &share_);
  for (int64_t id = 10; id < 13; ++id) ASSERT_TRUE(Add(alone, Item("solo", id, 10, 1, 0)).ok());
  EXPECT_EQ(Add(alone, Item("solo", 13, 10, 1, 0)).code(), StatusCode::kResourceExhausted);
}

TEST_F(FairQueueTest, TimedOutRequestsAreRefusedOrDelayedAsTheirPolicySays) {
  PriorityOptions p;
  p.levels = 1;
  BatchQueue q(options_, p, &share_);
  auto rejected = Item("a", 1, 10, 1, 1);
  rejected->queue_timeout = kT0 + 10ms;
  auto delayed = Item("a", 2, 10, 1, 1);
  delayed->queue_timeout = kT0 + 10ms;
  delayed->timeout_action = TimeoutAction::kDelay;
  ASSERT_TRUE(Add(q, std::move(rejected)).ok());
  ASSERT_TRUE(Add(q, std::move(delayed)).ok());
  ASSERT_TRUE(Add(q, Item("a", 3, 95, 1, 1)).ok());
  auto batch = q.Take(kT0 + 20ms, &dropped_, 1);
  ASSERT_EQ(dropped_.size(), 1u);
  EXPECT_EQ(dropped_[0].second.code(), StatusCode::kUnavailable);
  EXPECT_THAT(dropped_[0].second.message(), HasSubstr("past its timeout of 9999 us"));
  EXPECT_THAT(Ids(batch), ElementsAre(3));  // The delayed one goes after those in time.
  EXPECT_THAT(Ids(q.Take(kT0 + 20ms, &dropped_)), ElementsAre(2));
  EXPECT_EQ(share_.Queued("a"), 0);
}

TEST(PriorityOptionsTest, LevelsTimeoutsAndTheirChecks) {
  PriorityOptions p;
  EXPECT_EQ(*p.LevelOf(7), 0);  // No levels: priority ignored.
  p.levels = 3;
  EXPECT_EQ(*p.LevelOf(0), 3);  // Default: the lowest.
  p.default_level = 2;
  EXPECT_EQ(*p.LevelOf(0), 2);
  EXPECT_EQ(*p.LevelOf(1), 1);
  EXPECT_EQ(p.LevelOf(4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(p.LevelOf(UINT64_MAX).status().message(), HasSubstr("18446744073709551615"));
  p.default_policy.default_timeout_us = 1000;
  EXPECT_EQ(p.TimeoutUs(1, 10), 1000);  // No override allowed.
  p.default_policy.allow_timeout_override = true;
  EXPECT_EQ(p.TimeoutUs(1, 10), 10);
  EXPECT_EQ(p.TimeoutUs(1, 5000), 1000);  // Only shorter.
  EXPECT_EQ(p.TimeoutUs(1, UINT64_MAX), 1000);
  ASSERT_TRUE(ParseQueuePolicyFlag("2:max_queue_size=5,timeout_action=DELAY", &p).ok());
  EXPECT_EQ(p.PolicyOf(2).max_queue_size, 5);
  EXPECT_EQ(p.PolicyOf(2).timeout_action, TimeoutAction::kDelay);
  EXPECT_EQ(p.PolicyOf(2).default_timeout_us, 1000);  // From the default given before it.
  EXPECT_TRUE(p.Validate("flags").ok());
  for (const char* bad :
       {"x:max_queue_size=1", "1:max_queue_size=-1", "1:foo=1", "1", "default:timeout_action=DROP",
        "0:max_queue_size=1", "1:allow_timeout_override=yes",
        "1:max_queue_size=99999999999999999999"}) {
    PriorityOptions q;
    EXPECT_EQ(ParseQueuePolicyFlag(bad, &q).code(), StatusCode::kFailedPrecondition) << bad;
  }
  PriorityOptions q;
  q.levels = 2;
  q.level_policies[3] = {};
  EXPECT_THAT(q.Validate("models/m/config.json").message(),
              HasSubstr("priority_queue_policy names level 3"));
  q.level_policies.clear();
  q.default_level = 5;
  EXPECT_THAT(q.Validate("flags").message(), HasSubstr("default_priority_level is 5"));
}

TEST(PriorityOptionsTest, ATenantsCapClampsToItsBestLevelAndNeverRefuses) {
  PriorityOptions p;
  EXPECT_EQ(*p.LevelOf(1, 2), 0);  // No levels: nothing changes.
  p.levels = 3;
  p.default_level = 1;
  EXPECT_EQ(*p.LevelOf(1, 0), 1);  // 0: no cap.
  EXPECT_EQ(*p.LevelOf(1, 2), 2);  // More urgent than the cap: queued at the cap.
  EXPECT_EQ(*p.LevelOf(0, 2), 2);  // So is the model's default level when it is above the cap.
  EXPECT_EQ(*p.LevelOf(2, 2), 2);
  EXPECT_EQ(*p.LevelOf(3, 2), 3);  // Less urgent than the cap: as asked.
  EXPECT_EQ(*p.LevelOf(1, 1), 1);
  EXPECT_EQ(*p.LevelOf(1, 7), 3);  // A cap past the last level: the lowest.
  EXPECT_EQ(*p.LevelOf(2, INT64_MAX), 3);
  // A priority past the last level is still the client's mistake, capped or not.
  EXPECT_EQ(p.LevelOf(4, 2).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve
