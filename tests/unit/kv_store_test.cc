// KvStore: handles, budget and LRU eviction, expiry, one step at a time per session, NOT_FOUND
// messages that say why. No engine: caches are fakes that only report their size.
#include "server/kv_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class FakeCache : public KvCache {
 public:
  int64_t BytesFor(int64_t batch, int64_t capacity) const override { return batch * capacity * 100; }
};

class FakeModel : public AttentionModel {
 public:
  FakeModel() {
    spec_.name = "m";
    spec_.version = 1;
    spec_.weights_hash = "sha256:aa";
  }
  const ModelSpec& spec() const override { return spec_; }
  Status Forward(const AttendCall&, AttendOutputs*) const override { return Status::Ok(); }
  ModelSpec spec_;
};

struct Counts {
  int64_t bytes = 0, memories = 0, sessions = 0, hits = 0, misses = 0;
  std::map<std::string, int64_t> ends;  // "kind reason" -> count
  int64_t ended(const char* what) const {
    const auto it = ends.find(what);
    return it == ends.end() ? 0 : it->second;
  }
};

KvMetricsHooks HooksInto(Counts* c) {
  KvMetricsHooks h;
  h.on_size = [c](int64_t b, int64_t m, int64_t s) { c->bytes = b, c->memories = m, c->sessions = s; };
  h.on_lookup = [c](KvKind, bool hit) { ++(hit ? c->hits : c->misses); };
  h.on_end = [c](KvKind kind, KvEndReason reason) {
    ++c->ends[std::string(KvKindName(kind)) + " " + KvEndReasonName(reason)];
  };
  return h;
}

std::shared_ptr<KvEntry> NewMemory(KvStore& store, const std::shared_ptr<FakeModel>& model, int64_t len) {
  auto e = store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, len);
  EXPECT_TRUE(e.ok()) << e.status().message();
  if (!e.ok()) return nullptr;
  store.MarkReady(*e, len);
  return *e;
}

TEST(KvStoreTest, HandlesAreRandom128BitHexAndUnknownOnesSaySo) {
  KvStore store(KvOptions{});
  auto model = std::make_shared<FakeModel>();
  std::set<std::string> seen;
  for (int i = 0; i < 200; ++i) {
    auto e = NewMemory(store, model, 1);
    ASSERT_EQ(e->handle.size(), 32u);
    EXPECT_EQ(e->handle.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(e->handle);
  }
  EXPECT_EQ(seen.size(), 200u);
  auto miss = store.Lookup("00000000000000000000000000000000", KvKind::kMemory);
  ASSERT_FALSE(miss.ok());
  EXPECT_EQ(miss.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(miss.status().message(), HasSubstr("unknown"));
  // A session's handle is not a memory's.
  auto s = store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0);
  ASSERT_TRUE(s.ok());
  auto wrong = store.Lookup((*s)->handle, KvKind::kMemory);
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("is a session, not a memory"));
}

TEST(KvStoreTest, BudgetEvictsLeastRecentlyUsedButNeverWhatIsInUse) {
  Counts counts;
  KvOptions o;
  o.budget_bytes = 1000;
  o.max_entry_bytes = 600;
  KvStore store(o, HooksInto(&counts));
  auto model = std::make_shared<FakeModel>();
  auto a = NewMemory(store, model, 3);  // 300 bytes each
  auto b = NewMemory(store, model, 3);
  auto c = NewMemory(store, model, 3);
  EXPECT_EQ(counts.bytes, 900);
  EXPECT_EQ(counts.memories, 3);
  ASSERT_TRUE(store.Lookup(a->handle, KvKind::kMemory).ok());  // a is now the most recent
  const std::string a_handle = a->handle, b_handle = b->handle, c_handle = c->handle;
  std::shared_ptr<KvEntry> in_use = c;  // A running request holds c.
  a.reset();
  b.reset();
  c.reset();
  auto d = NewMemory(store, model, 3);  // Needs 300: b (least recent, not in use) goes.
  ASSERT_TRUE(d);
  EXPECT_EQ(counts.ended("memory evicted"), 1);
  auto gone = store.Lookup(b_handle, KvKind::kMemory);
  ASSERT_FALSE(gone.ok());
  EXPECT_THAT(gone.status().message(), HasSubstr("evicted"));
  EXPECT_TRUE(store.Lookup(a_handle, KvKind::kMemory).ok());
  EXPECT_TRUE(store.Lookup(c_handle, KvKind::kMemory).ok());
  // a and c are in use: even evicting d would not make room for 600, so nothing is evicted and the
  // request is refused.
  std::shared_ptr<KvEntry> a_held = *store.Lookup(a_handle, KvKind::kMemory);
  d.reset();
  auto big = store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, 6);  // 600
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("--kv-budget-bytes"));
  EXPECT_TRUE(store.Lookup(c_handle, KvKind::kMemory).ok());
  // Over the per-entry limit: INVALID_ARGUMENT naming the flag.
  auto huge = store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, 7);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("--kv-max-entry-bytes"));
  // A deleted entry still in use keeps its bytes counted until its holder lets go.
  ASSERT_TRUE(store.Release(c_handle, KvKind::kMemory).ok());
  EXPECT_GE(store.bytes(), 600);
  in_use.reset();
  a_held.reset();
  EXPECT_EQ(store.bytes(), 600);  // a and d
  EXPECT_EQ(counts.ended("memory evicted"), 1);
  EXPECT_THAT(store.Lookup(c_handle, KvKind::kMemory).status().message(), HasSubstr("deleted"));
  EXPECT_EQ(counts.ended("memory released"), 1);
  EXPECT_EQ(counts.ends.size(), 2u);
}

TEST(KvStoreTest, SessionStepsAreOneAtATimeAndGrowByDoubling) {
  KvStore store(KvOptions{});
  auto model = std::make_shared<FakeModel>();
  auto s = store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 2, 0);
  ASSERT_TRUE(s.ok());
  const std::string h = (*s)->handle;
  auto first = store.BeginStep(h, 5, -1);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->length, 0);
  EXPECT_EQ(first->capacity, 16);
  auto second = store.BeginStep(h, 1, -1);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAborted);
  store.EndStep(*first, true, 5);
  auto wrong_length = store.BeginStep(h, 1, 4);
  ASSERT_FALSE(wrong_length.ok());
  EXPECT_EQ(wrong_length.status().code(), StatusCode::kAborted);
  EXPECT_THAT(wrong_length.status().message(), HasSubstr("holds 5 tokens"));
  auto grow = store.BeginStep(h, 12, 5);
  ASSERT_TRUE(grow.ok());
  EXPECT_EQ(grow->capacity, 32);  // 17 needed: doubled
  EXPECT_EQ(store.bytes(), 2 * 32 * 100);
  store.EndStep(*grow, false, 12);  // A failed step leaves the session as it was.
  auto again = store.BeginStep(h, 1, 5);
  ASSERT_TRUE(again.ok());
  store.EndStep(*again, true, 1);
  EXPECT_EQ((*s)->length, 6);
  auto closed = store.Release(h, KvKind::kSession);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(*closed, 2 * 32 * 100);
  EXPECT_THAT(store.BeginStep(h, 1, -1).status().message(), HasSubstr("closed"));
}

TEST(KvStoreTest, UnusedEntriesExpireAndReloadEndsItsModelsEntries) {
  Counts counts;
  KvOptions o;
  o.ttl_seconds = 60;
  KvStore store(o, HooksInto(&counts));
  auto model = std::make_shared<FakeModel>();
  auto old_entry = NewMemory(store, model, 1);
  auto fresh = NewMemory(store, model, 1);
  const std::string old_handle = old_entry->handle, fresh_handle = fresh->handle;
  old_entry.reset();
  fresh.reset();
  store.ExpireIdle(KvClock::now() + std::chrono::seconds(30));
  EXPECT_EQ(store.size(), 2u);
  ASSERT_TRUE(store.Lookup(fresh_handle, KvKind::kMemory).ok());  // renewed now
  // 61 s on, both were last used more than 60 s before: both expire.
  store.ExpireIdle(KvClock::now() + std::chrono::seconds(61));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(counts.ended("memory expired"), 2);
  EXPECT_THAT(store.Lookup(old_handle, KvKind::kMemory).status().message(), HasSubstr("expired"));
  // A reload that unloads the model version ends its entries, saying so.
  auto kept = NewMemory(store, model, 1);
  const std::string kept_handle = kept->handle;
  kept.reset();
  store.EndModel(model->spec());
  auto ended = store.Lookup(kept_handle, KvKind::kMemory);
  ASSERT_FALSE(ended.ok());
  EXPECT_THAT(ended.status().message(), HasSubstr("unloaded by a reload"));
  EXPECT_EQ(counts.memories, 0);
  EXPECT_EQ(counts.bytes, 0);
  EXPECT_EQ(counts.ended("memory unloaded"), 1);
  // Shutdown ends what is left, counted as such.
  auto s = store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0);
  ASSERT_TRUE(s.ok());
  s->reset();
  store.Clear("the server is shutting down");
  EXPECT_EQ(counts.ended("session shutdown"), 1);
  EXPECT_EQ(counts.ends.size(), 3u);
}

}  // namespace
}  // namespace attnserve
