// Kept keys and values between tenants: only the maker finds its entries, a tenant's cap refuses
// it by name, and another tenant's pressure never takes a tenant below its guarantee, checked
// over random operation sequences with an exact model of who holds what.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "server/core/checked_math.h"
#include "server/kv/kv_store.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// 100 bytes a token.
class Cache : public KvCache {
 public:
  std::optional<int64_t> BytesFor(int64_t batch, int64_t capacity) const override {
    if (batch < 0 || capacity < 0) return std::nullopt;
    return CheckedMul({batch, capacity, 100});
  }
  int64_t AllocatedTokens() const override { return allocated; }
  int64_t SharedTokens() const override { return 0; }
  Plan PlanAppend(int64_t) const override { return Plan{0, allocated, false}; }
  Status ShareFrom(KvCache&, int64_t length) override {
    allocated = length;
    return Status::Ok();
  }
  int64_t allocated = 0;
};

class Model : public AttentionModel {
 public:
  Model() {
    spec_.name = "m";
    spec_.weights_hash = "sha256:aa";
  }
  const ModelSpec& spec() const override { return spec_; }
  Status Forward(const AttendCall&, AttendOutputs*) const override { return Status::Ok(); }
  ModelSpec spec_;
};

std::shared_ptr<const Tenants> TenantsOf(const std::string& json) {
  auto t = Tenants::Parse(json, "tenants.json");
  EXPECT_TRUE(t.ok()) << t.status().message();
  return *t;
}

class KvTenantsTest : public ::testing::Test {
 protected:
  KvTenantsTest() : store_(Options(), hooks(), [this] { return now_; }) {}
  static KvOptions Options() {
    KvOptions o;
    o.budget_bytes = 10000;
    o.max_entry_bytes = 5000;
    return o;
  }
  KvMetricsHooks hooks() {
    KvMetricsHooks h;
    h.on_tenant_bytes = [this](const std::string& label, int64_t bytes) { labels_[label] = bytes; };
    return h;
  }
  // A memory of `tokens` tokens (100 bytes each) made by `tenant`.
  StatusOr<std::string> Memory(const std::string& tenant, int64_t tokens) {
    ASSIGN_OR_RETURN(
        std::shared_ptr<KvEntry> e,
        store_.Create(KvKind::kMemory, model_, std::make_shared<Cache>(), 1, tokens, tenant));
    RETURN_IF_ERROR(store_.MarkReady(e, tokens));
    return e->handle;
  }
  std::shared_ptr<const AttentionModel> model_ = std::make_shared<Model>();
  KvClock::time_point now_ = KvClock::time_point(std::chrono::hours(1));
  std::map<std::string, int64_t> labels_;
  KvStore store_;
};

TEST_F(KvTenantsTest, OnlyTheMakerFindsItsEntriesAndOthersSeeNothingThere) {
  auto mine = Memory("a", 10);
  ASSERT_TRUE(mine.ok());
  auto session = store_.Create(KvKind::kSession, model_, std::make_shared<Cache>(), 1, 0, "a");
  ASSERT_TRUE(session.ok());
  const std::string s = (*session)->handle;
  EXPECT_TRUE(store_.Lookup(*mine, KvKind::kMemory, "a").ok());
  for (const Status& st :
       {store_.Lookup(*mine, KvKind::kMemory, "b").status(),
        store_.BeginStep(s, std::nullopt, "b").status(),
        store_.Fork(s, std::make_shared<Cache>(), "b").status(), store_.Truncate(s, 0, "b"),
        store_.Release(*mine, KvKind::kMemory, "b").status(),
        store_.Release(s, KvKind::kSession, "default").status()}) {
    EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.message();
    EXPECT_THAT(st.message(), HasSubstr("unknown: this server holds no"));
  }
  // Still there for its maker; a fork is charged to (and owned by) the forker.
  auto fork = store_.Fork(s, std::make_shared<Cache>(), "a");
  ASSERT_TRUE(fork.ok()) << fork.status().message();
  EXPECT_EQ((*fork)->tenant, "a");
  EXPECT_TRUE(store_.Release(*mine, KvKind::kMemory, "a").ok());
}

// `message` with every `from` replaced by `to`: two answers compared as if about one handle.
std::string Renamed(std::string message, const std::string& from, const std::string& to) {
  for (size_t at = message.find(from); !from.empty() && at != std::string::npos;
       at = message.find(from, at + to.size())) {
    message.replace(at, from.size(), to);
  }
  return message;
}

// Another tenant's handle, open or ended, of either kind, answers every call exactly as a handle
// never made (the handle it names aside): a tenant learns nothing of what others hold or held.
TEST_F(KvTenantsTest, AnotherTenantsHandleOpenOrClosedAnswersAsOneNeverMade) {
  auto session = store_.Create(KvKind::kSession, model_, std::make_shared<Cache>(), 1, 0, "b");
  auto closed = store_.Create(KvKind::kSession, model_, std::make_shared<Cache>(), 1, 0, "b");
  ASSERT_TRUE(session.ok() && closed.ok());
  auto memory = Memory("b", 10), deleted = Memory("b", 10);
  ASSERT_TRUE(memory.ok() && deleted.ok());
  ASSERT_TRUE(store_.Release((*closed)->handle, KvKind::kSession, "b").ok());
  ASSERT_TRUE(store_.Release(*deleted, KvKind::kMemory, "b").ok());
  const std::string never = store_.replica_id() + std::string(24, '7');
  const auto calls = [this](const std::string& h) {
    return std::vector<Status>{store_.Lookup(h, KvKind::kMemory, "a").status(),
                               store_.Lookup(h, KvKind::kSession, "a").status(),
                               store_.BeginStep(h, std::nullopt, "a").status(),
                               store_.Fork(h, std::make_shared<Cache>(), "a").status(),
                               store_.Truncate(h, 0, "a"),
                               store_.Release(h, KvKind::kMemory, "a").status(),
                               store_.Release(h, KvKind::kSession, "a").status()};
  };
  const std::vector<Status> want = calls(never);
  for (const std::string& h : {(*session)->handle, (*closed)->handle, *memory, *deleted}) {
    const std::vector<Status> got = calls(h);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].code(), want[i].code()) << "call " << i << ": " << got[i].message();
      EXPECT_EQ(Renamed(got[i].message(), h, never), want[i].message()) << "call " << i;
    }
  }
  // Its maker still learns why it is gone.
  EXPECT_THAT(store_.Lookup((*closed)->handle, KvKind::kSession, "b").status().message(),
              HasSubstr("closed (CloseSession)"));
}

TEST_F(KvTenantsTest, ATenantAtItsCapIsRefusedByName) {
  store_.SetTenants(TenantsOf(R"({"tenants": {"b": {"kv_max_bytes": 3000}}})"));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Memory("b", 10).ok());
  auto refused = Memory("b", 10);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("tenant 'b' holds 3000 bytes of memories and sessions and needs 1000 more, "
                        "over its kv_max_bytes 3000"));
  EXPECT_TRUE(Memory("c", 10).ok());  // Others are not.
  EXPECT_EQ(store_.TenantBytes("b"), 3000);
  EXPECT_EQ(labels_["b"], 3000);
  EXPECT_EQ(labels_["other"], 1000);  // "c" is not named: counted as other.
}

TEST_F(KvTenantsTest, AFloodNeverTakesAnotherTenantBelowItsGuarantee) {
  store_.SetTenants(TenantsOf(R"({"tenants": {"a": {"kv_guaranteed_bytes": 4000}}})"));
  std::vector<std::string> kept;
  for (int i = 0; i < 5; ++i) kept.push_back(*Memory("a", 10));  // a holds 5000.
  for (int i = 0; i < 200; ++i) {
    now_ += std::chrono::seconds(1);  // b's are always the more recent.
    ASSERT_TRUE(Memory("b", 10).ok()) << i;
  }
  // a lost at most what took it to its guarantee, its least recently used first.
  int found = 0;
  for (const std::string& h : kept) found += store_.Lookup(h, KvKind::kMemory, "a").ok() ? 1 : 0;
  EXPECT_EQ(found, 4);
  EXPECT_FALSE(store_.Lookup(kept[0], KvKind::kMemory, "a").ok());
  EXPECT_EQ(store_.TenantBytes("a"), 4000);
  // b's own entries make room for b; a 5000-byte one of b's needs more than b can free.
  auto big = Memory("b", 50);
  ASSERT_TRUE(big.ok()) << big.status().message();
  EXPECT_EQ(store_.TenantBytes("a"), 4000);
}

// Random creations, steps, releases and reloads of the terms by three tenants: whenever an entry
// of one tenant is evicted by another's call, the tenant it belonged to still holds at least its
// guarantee; no tenant ever holds more than its cap; the tenants' bytes add up to the store's.
TEST_F(KvTenantsTest, RandomOperationsKeepEveryGuaranteeAndCap) {
  const std::vector<std::string> names{"a", "b", "c"};
  const auto terms = TenantsOf(R"({"tenants": {"a": {"kv_guaranteed_bytes": 3000},
      "b": {"kv_guaranteed_bytes": 2000, "kv_max_bytes": 6000}, "c": {"weight": 2}}})");
  store_.SetTenants(terms);
  for (uint32_t seed : {1u, 2u, 3u, 4u}) {
    std::mt19937 rng(seed);
    std::map<std::string, std::set<std::string>> held;  // What each tenant made and did not end.
    for (int op = 0; op < 2000; ++op) {
      now_ += std::chrono::milliseconds(10);
      const std::string& t = names[rng() % names.size()];
      std::map<std::string, int64_t> before;
      for (const auto& n : names) before[n] = store_.TenantBytes(n);
      const int kind = static_cast<int>(rng() % 4);
      if (kind <= 1) {
        auto h = Memory(t, 1 + static_cast<int64_t>(rng() % 30));
        if (h.ok()) held[t].insert(*h);
      } else if (kind == 2 && !held[t].empty()) {
        auto it = std::next(held[t].begin(), static_cast<long>(rng() % held[t].size()));
        (void)store_.Release(*it, KvKind::kMemory, t);
        held[t].erase(it);
      } else if (!held[t].empty()) {
        (void)store_.Lookup(*held[t].begin(), KvKind::kMemory, t);  // Touched: recent.
      }
      for (const auto& n : names) {
        // Drop what ended (evicted); check who lost what.
        bool lost = false;
        for (auto it = held[n].begin(); it != held[n].end();) {
          if (store_.Lookup(*it, KvKind::kMemory, n).ok()) {
            ++it;
          } else {
            lost = true;
            it = held[n].erase(it);
          }
        }
        const TenantPolicy& p = terms->Of(n);
        if (lost && n != t) {
          EXPECT_GE(store_.TenantBytes(n), std::min(before[n], p.kv_guaranteed_bytes))
              << "seed " << seed << " op " << op << ": " << t << " took " << n
              << " below its guarantee";
        }
        if (p.kv_max_bytes > 0) ASSERT_LE(store_.TenantBytes(n), p.kv_max_bytes);
      }
      int64_t sum = 0;
      for (const auto& n : names) sum += store_.TenantBytes(n);
      ASSERT_EQ(sum, store_.bytes()) << "seed " << seed << " op " << op;
      ASSERT_LE(store_.bytes(), 10000);
    }
    store_.Clear("next seed");
    for (const auto& n : names) ASSERT_EQ(store_.TenantBytes(n), 0);
  }
}

}  // namespace
}  // namespace attnserve
