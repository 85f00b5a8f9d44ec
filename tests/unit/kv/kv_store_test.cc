// KvStore: handles, budget and LRU eviction, expiry, one step at a time per session, NOT_FOUND
// messages that say why. No engine: caches are fakes that only report their size.
#include "server/kv/kv_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <set>

#include "server/core/checked_math.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// 100 bytes a token; `allocated` is what a step's compute grew it to (the engine's part).
class FakeCache : public KvCache {
 public:
  std::optional<int64_t> BytesFor(int64_t batch, int64_t capacity) const override {
    if (batch < 0 || capacity < 0) return std::nullopt;
    return CheckedMul({batch, capacity, 100});
  }
  int64_t AllocatedTokens() const override { return allocated; }
  int64_t SharedTokens() const override { return shared; }
  // A fork's shared tokens stay shared until a step goes back into them.
  Plan PlanAppend(int64_t held) const override {
    return held < shared ? Plan{held, 0, false} : Plan{shared, allocated - shared, false};
  }
  Status ShareFrom(KvCache&, int64_t length) override {
    allocated = shared = length;
    return Status::Ok();
  }
  int64_t allocated = 0, shared = 0;
};

std::unique_ptr<KvStep> Begin(KvStore& store, const std::string& handle,
                              std::optional<int64_t> expected) {
  auto step = store.BeginStep(handle, expected, kDefaultTenant);
  EXPECT_TRUE(step.ok()) << step.status().message();
  return step.ok() ? std::move(*step) : nullptr;
}

// What the engine does for a step that computes: grows the cache to the step's capacity.
void Compute(const KvStep& step) {
  static_cast<FakeCache&>(*step.entry()->cache).allocated = step.capacity();
}

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
  h.on_size = [c](int64_t b, int64_t m, int64_t s) {
    c->bytes = b, c->memories = m, c->sessions = s;
  };
  h.on_lookup = [c](KvKind, bool hit) { ++(hit ? c->hits : c->misses); };
  h.on_end = [c](KvKind kind, KvEndReason reason) {
    ++c->ends[std::string(KvKindName(kind)) + " " + KvEndReasonName(reason)];
  };
  return h;
}

std::shared_ptr<KvEntry> NewMemory(KvStore& store, const std::shared_ptr<FakeModel>& model,
                                   int64_t len) {
  auto e =
      store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, len, kDefaultTenant);
  EXPECT_TRUE(e.ok()) << e.status().message();
  if (!e.ok()) return nullptr;
  static_cast<FakeCache&>(*(*e)->cache).allocated = len;
  EXPECT_TRUE(store.MarkReady(*e, len).ok());
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
  // Each starts with the replica's ID, 8 hex digits; the rest is 96 random bits.
  ASSERT_EQ(store.replica_id().size(), 8u);
  for (const std::string& h : seen) EXPECT_EQ(h.substr(0, 8), store.replica_id()) << h;
  auto miss = store.Lookup(store.replica_id() + "000000000000000000000000", KvKind::kMemory,
                           kDefaultTenant);
  ASSERT_FALSE(miss.ok());
  EXPECT_EQ(miss.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(miss.status().message(), HasSubstr("unknown"));
  // A session's handle is not a memory's.
  auto s =
      store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant);
  ASSERT_TRUE(s.ok());
  auto wrong = store.Lookup((*s)->handle, KvKind::kMemory, kDefaultTenant);
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("is a session, not a memory"));
}

TEST(KvStoreTest, AHandleOfAnotherReplicaNamesBothReplicas) {
  KvStore here(KvOptions{}), there(KvOptions{});
  ASSERT_NE(here.replica_id(), there.replica_id());  // 1 in 2^32 to fail by chance
  auto model = std::make_shared<FakeModel>();
  auto s =
      there.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant);
  ASSERT_TRUE(s.ok());
  auto miss = here.Lookup((*s)->handle, KvKind::kSession, kDefaultTenant);
  ASSERT_FALSE(miss.ok());
  EXPECT_EQ(miss.status().code(), StatusCode::kNotFound);
  const std::string& m = miss.status().message();
  EXPECT_THAT(m, HasSubstr("made by replica " + there.replica_id()));
  EXPECT_THAT(m, HasSubstr("this is replica " + here.replica_id() + ":"));
  EXPECT_THAT(m, HasSubstr("KvHandle.replica"));
  EXPECT_THAT(m, Not(HasSubstr("unknown")));
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
  ASSERT_TRUE(
      store.Lookup(a->handle, KvKind::kMemory, kDefaultTenant).ok());  // a is now the most recent
  const std::string a_handle = a->handle, b_handle = b->handle, c_handle = c->handle;
  std::shared_ptr<KvEntry> in_use = c;  // A running request holds c.
  a.reset();
  b.reset();
  c.reset();
  auto d = NewMemory(store, model, 3);  // Needs 300: b (least recent, not in use) goes.
  ASSERT_TRUE(d);
  EXPECT_EQ(counts.ended("memory evicted"), 1);
  auto gone = store.Lookup(b_handle, KvKind::kMemory, kDefaultTenant);
  ASSERT_FALSE(gone.ok());
  EXPECT_THAT(gone.status().message(), HasSubstr("evicted"));
  EXPECT_TRUE(store.Lookup(a_handle, KvKind::kMemory, kDefaultTenant).ok());
  EXPECT_TRUE(store.Lookup(c_handle, KvKind::kMemory, kDefaultTenant).ok());
  // a and c are in use: even evicting d would not make room for 600, so nothing is evicted and the
  // request is refused.
  std::shared_ptr<KvEntry> a_held = *store.Lookup(a_handle, KvKind::kMemory, kDefaultTenant);
  d.reset();
  auto big = store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, 6,
                          kDefaultTenant);  // 600
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("--kv-budget-bytes"));
  EXPECT_TRUE(store.Lookup(c_handle, KvKind::kMemory, kDefaultTenant).ok());
  // Over the per-entry limit: INVALID_ARGUMENT naming the flag.
  auto huge =
      store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, 7, kDefaultTenant);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("--kv-max-entry-bytes"));
  // A deleted entry still in use keeps its bytes counted until its holder lets go.
  ASSERT_TRUE(store.Release(c_handle, KvKind::kMemory, kDefaultTenant).ok());
  EXPECT_GE(store.bytes(), 600);
  in_use.reset();
  a_held.reset();
  EXPECT_EQ(store.bytes(), 600);  // a and d
  EXPECT_EQ(counts.ended("memory evicted"), 1);
  EXPECT_THAT(store.Lookup(c_handle, KvKind::kMemory, kDefaultTenant).status().message(),
              HasSubstr("deleted"));
  EXPECT_EQ(counts.ended("memory released"), 1);
  EXPECT_EQ(counts.ends.size(), 2u);
}

TEST(KvStoreTest, SessionStepsAreOneAtATimeAndGrowByDoubling) {
  KvStore store(KvOptions{});
  auto model = std::make_shared<FakeModel>();
  auto s =
      store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 2, 0, kDefaultTenant);
  ASSERT_TRUE(s.ok());
  const std::string h = (*s)->handle;
  auto first = store.BeginStep(h, std::nullopt, kDefaultTenant);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*first)->length(), 0);
  ASSERT_TRUE((*first)->Reserve(5).ok());
  EXPECT_EQ((*first)->capacity(), 16);
  auto second = store.BeginStep(h, std::nullopt, kDefaultTenant);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAborted);
  Compute(**first);
  (*first)->End(true);
  auto wrong_length = store.BeginStep(h, 4, kDefaultTenant);
  ASSERT_FALSE(wrong_length.ok());
  EXPECT_EQ(wrong_length.status().code(), StatusCode::kAborted);
  EXPECT_THAT(wrong_length.status().message(), HasSubstr("holds 5 tokens"));
  auto grow = store.BeginStep(h, 5, kDefaultTenant);
  ASSERT_TRUE(grow.ok());
  ASSERT_TRUE((*grow)->Reserve(12).ok());
  EXPECT_EQ((*grow)->capacity(), 32);  // 17 needed: doubled
  EXPECT_EQ(store.bytes(), 2 * 32 * 100);
  Compute(**grow);
  (*grow)->End(
      false);  // Failed after its cache grew: the length is as it was, the growth stays counted.
  EXPECT_EQ((*s)->length, 5);
  EXPECT_EQ(store.bytes(), 2 * 32 * 100);
  auto again = store.BeginStep(h, 5, kDefaultTenant);
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE((*again)->Reserve(1).ok());
  (*again)->End(true);
  EXPECT_EQ((*s)->length, 6);
  auto closed = store.Release(h, KvKind::kSession, kDefaultTenant);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(*closed, 2 * 32 * 100);
  EXPECT_THAT(store.BeginStep(h, std::nullopt, kDefaultTenant).status().message(),
              HasSubstr("closed"));
}

// TruncateSession: back to any length it holds, never while a step is in flight, never beyond its
// length or below 0; the next step starts there and the allocation stays.
TEST(KvStoreTest, TruncateTakesBackTokensBetweenSteps) {
  KvStore store(KvOptions{});
  auto model = std::make_shared<FakeModel>();
  auto s =
      store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant);
  ASSERT_TRUE(s.ok());
  const std::string h = (*s)->handle;
  auto step = Begin(store, h, 0);
  ASSERT_TRUE(step->Reserve(9).ok());
  Compute(*step);
  EXPECT_EQ(store.Truncate(h, 4, kDefaultTenant).code(), StatusCode::kAborted);  // In flight.
  step->End(true);
  EXPECT_EQ((*s)->length, 9);
  for (const int64_t bad : {int64_t{-1}, int64_t{10}, std::numeric_limits<int64_t>::max(),
                            std::numeric_limits<int64_t>::min()}) {
    const Status st = store.Truncate(h, bad, kDefaultTenant);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(st.message(), HasSubstr("allowed: 0 to 9")) << bad;
  }
  const int64_t bytes = store.bytes();
  ASSERT_TRUE(store.Truncate(h, 4, kDefaultTenant).ok());
  EXPECT_EQ((*s)->length, 4);
  EXPECT_EQ(store.bytes(), bytes);  // The allocation stays for the steps to come.
  ASSERT_TRUE(
      store.Truncate(h, 4, kDefaultTenant).ok());  // Idempotent: a retried truncation is harmless.
  EXPECT_EQ(store.BeginStep(h, 9, kDefaultTenant).status().code(), StatusCode::kAborted);
  auto next = Begin(store, h, 4);
  ASSERT_TRUE(next->Reserve(2).ok());
  next->End(true);
  EXPECT_EQ((*s)->length, 6);
  ASSERT_TRUE(store.Truncate(h, 0, kDefaultTenant).ok());
  EXPECT_EQ((*s)->length, 0);
  auto memory = NewMemory(store, model, 3);
  EXPECT_THAT(store.Truncate(memory->handle, 0, kDefaultTenant).message(),
              HasSubstr("is a memory, not a session"));
  ASSERT_TRUE(store.Release(h, KvKind::kSession, kDefaultTenant).ok());
  EXPECT_THAT(store.Truncate(h, 0, kDefaultTenant).message(), HasSubstr("closed"));
}

// ForkSession: the parent's tokens shared, not copied (the fork counts 0 bytes until it writes its
// own), never while a step is in flight; the parent is free again afterwards and the two step on
// their own, the fork's first step counting only its own tokens.
TEST(KvStoreTest, ForkSharesTheSessionAsItIs) {
  KvStore store(KvOptions{});
  auto model = std::make_shared<FakeModel>();
  auto s =
      store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 2, 0, kDefaultTenant);
  ASSERT_TRUE(s.ok());
  const std::string h = (*s)->handle;
  auto step = Begin(store, h, 0);
  ASSERT_TRUE(step->Reserve(5).ok());
  Compute(*step);
  EXPECT_EQ(store.Fork(h, std::make_shared<FakeCache>(), kDefaultTenant).status().code(),
            StatusCode::kAborted);
  step->End(true);
  const int64_t one = store.bytes();
  auto fork = store.Fork(h, std::make_shared<FakeCache>(), kDefaultTenant);
  ASSERT_TRUE(fork.ok()) << fork.status().message();
  EXPECT_NE((*fork)->handle, h);
  EXPECT_EQ((*fork)->length, 5);
  EXPECT_EQ((*fork)->capacity, 5);
  EXPECT_EQ((*fork)->bytes, 0);
  EXPECT_EQ(store.bytes(), one);
  EXPECT_FALSE((*s)->busy);
  auto a = Begin(store, h, 5), b = Begin(store, (*fork)->handle, 5);  // Both at once.
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(b->Reserve(1).ok());
  EXPECT_EQ(b->capacity(), 5 + 16);  // Its own tokens: at least 16, after the 5 shared.
  EXPECT_EQ((*fork)->bytes, 2 * 16 * 100);
  Compute(*b);
  b->End(true);
  EXPECT_EQ((*fork)->length, 6);
  EXPECT_EQ((*fork)->bytes, 2 * 16 * 100);
  EXPECT_EQ(store.bytes(), one + 2 * 16 * 100);
  a->End(false);
  EXPECT_THAT(store
                  .Fork(store.replica_id() + std::string(24, '0'), std::make_shared<FakeCache>(),
                        kDefaultTenant)
                  .status()
                  .message(),
              HasSubstr("unknown"));
  // A fork takes no room; its first step is refused when the budget cannot hold its own tokens.
  KvOptions small;
  small.budget_bytes = small.max_entry_bytes = 2 * 16 * 100;
  KvStore tight(small);
  auto t =
      tight.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 2, 0, kDefaultTenant);
  ASSERT_TRUE(t.ok());
  auto ts = Begin(tight, (*t)->handle, 0);
  ASSERT_TRUE(ts->Reserve(3).ok());
  Compute(*ts);
  ts->End(true);
  auto tf = tight.Fork((*t)->handle, std::make_shared<FakeCache>(), kDefaultTenant);
  ASSERT_TRUE(tf.ok()) << tf.status().message();
  EXPECT_EQ(tight.size(), 2u);
  EXPECT_EQ(tight.bytes(), 2 * 16 * 100);
  EXPECT_FALSE((*t)->busy);
  auto fs = Begin(tight, (*tf)->handle, 3);
  const Status refused = fs->Reserve(1);  // The parent is busy-free but the only thing to evict.
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.message();
  fs->End(false);
  EXPECT_EQ((*tf)->bytes, 0);
}

// A step that claimed ~2^62 tokens reserved an overflowed byte count, left its session at
// that capacity (every later step failed) and took the budget's gauge to 0 or below.
TEST(KvStoreTest, StepsThatOverflowOrFailBeforeComputingChangeNothing) {
  Counts counts;
  KvOptions o;
  o.budget_bytes = 100000;
  o.max_entry_bytes = 50000;
  KvStore store(o, HooksInto(&counts));
  auto model = std::make_shared<FakeModel>();
  auto s =
      store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 2, 0, kDefaultTenant);
  ASSERT_TRUE(s.ok());
  const std::string h = (*s)->handle;
  {
    auto step = Begin(store, h, 0);
    ASSERT_TRUE(step->Reserve(3).ok());
    Compute(*step);
    step->End(true);
  }
  const int64_t bytes = store.bytes();
  EXPECT_EQ(bytes, 2 * 16 * 100);
  const int64_t max = std::numeric_limits<int64_t>::max();
  for (int64_t tokens : {int64_t{4611686018427387901}, int64_t{1} << 62, max, max - 2, int64_t{-1},
                         std::numeric_limits<int64_t>::min(), int64_t{251}}) {
    auto step = Begin(store, h, 3);
    const Status st = step->Reserve(tokens);
    ASSERT_FALSE(st.ok()) << tokens;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << tokens;
    EXPECT_EQ(store.bytes(), bytes) << tokens;
    EXPECT_EQ(counts.bytes, bytes) << tokens;
    EXPECT_EQ((*s)->capacity, 16) << tokens;
  }  // Each ends as not applied when it goes.
  // A reservation given back: a step that fails before computing.
  {
    auto step = Begin(store, h, 3);
    ASSERT_TRUE(step->Reserve(20).ok());
    EXPECT_EQ(step->capacity(), 32);
    EXPECT_EQ(store.bytes(), 2 * 32 * 100);
  }
  EXPECT_EQ(store.bytes(), bytes);
  EXPECT_EQ((*s)->capacity, 16);
  EXPECT_EQ((*s)->length, 3);
  EXPECT_FALSE((*s)->busy);
  // Doubling past one entry's limit falls back to what is needed: 3 + 240 tokens of 200 bytes.
  auto step = Begin(store, h, 3);
  ASSERT_TRUE(step->Reserve(240).ok());
  EXPECT_EQ(step->capacity(), 243);
  EXPECT_EQ(store.bytes(), 2 * 243 * 100);
  // Negative session_length: INVALID_ARGUMENT naming the field (the step in flight is untouched).
  for (int64_t bad :
       {int64_t{-1}, int64_t{-(int64_t{1} << 62)}, std::numeric_limits<int64_t>::min()}) {
    auto refused = store.BeginStep(h, bad, kDefaultTenant);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("session_length: " + std::to_string(bad)));
  }
  EXPECT_TRUE((*s)->busy);
}

TEST(KvStoreTest, CreateRefusesSizesOutOfRangeAndCountsNothing) {
  KvStore store(KvOptions{});
  auto model = std::make_shared<FakeModel>();
  const int64_t max = std::numeric_limits<int64_t>::max();
  for (auto [batch, capacity] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {-1, 1}, {1, -1}, {max, max}, {1 << 20, int64_t{1} << 50}, {max, 1}, {1, max}}) {
    auto e = store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), batch, capacity,
                          kDefaultTenant);
    ASSERT_FALSE(e.ok()) << batch << " x " << capacity;
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(store.bytes(), 0);
  EXPECT_EQ(store.size(), 0u);
}

TEST(KvStoreTest, EntriesAreBoundedByMaxEntries) {
  KvOptions o;
  o.max_entries = 3;
  KvStore store(o);
  auto model = std::make_shared<FakeModel>();
  std::vector<std::string> handles;
  for (int i = 0; i < 3; ++i)
    handles.push_back((*store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0,
                                     kDefaultTenant))
                          ->handle);
  for (KvKind kind : {KvKind::kSession, KvKind::kMemory}) {
    auto refused = store.Create(kind, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(refused.status().message(), HasSubstr("--kv-max-entries"));
  }
  ASSERT_TRUE(store.Release(handles[0], KvKind::kSession, kDefaultTenant).ok());
  EXPECT_TRUE(
      store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant)
          .ok());
  EXPECT_EQ(store.size(), 3u);
}

// The sweep removed a memory still being computed, and completing it then touched freed
// memory (SIGSEGV); and it stopped at a busy least recently used entry, so one long step held up
// the expiry of every other. The clock is the test's.
TEST(KvStoreTest, ExpirySkipsEntriesInUseAndIsNotHeldUpByThem) {
  Counts counts;
  KvOptions o;
  o.ttl_seconds = 10;
  auto now = KvClock::time_point{} + std::chrono::hours(1);
  KvStore store(o, HooksInto(&counts), [&now] { return now; });
  auto model = std::make_shared<FakeModel>();
  auto busy =
      *store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant);
  auto step = Begin(store, busy->handle, std::nullopt);
  now += std::chrono::seconds(1);
  auto creating =
      *store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, 4, kDefaultTenant);
  now += std::chrono::seconds(1);
  auto idle =
      *store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant);
  const std::string idle_handle = idle->handle;
  idle.reset();
  std::shared_ptr<KvEntry> held = NewMemory(store, model, 2);  // A request holds it.
  now += std::chrono::seconds(11);
  store.ExpireIdle(now);
  // Only `idle` went: the busy session, the memory being computed and the held one stay.
  EXPECT_EQ(store.size(), 3u);
  EXPECT_EQ(counts.ended("session expired"), 1);
  EXPECT_THAT(store.Lookup(idle_handle, KvKind::kSession, kDefaultTenant).status().message(),
              HasSubstr("expired (unused for 10 s"));
  static_cast<FakeCache&>(*creating->cache).allocated = 4;
  ASSERT_TRUE(store.MarkReady(creating, 4).ok());  // Renewed: computed now.
  EXPECT_TRUE(store.Lookup(creating->handle, KvKind::kMemory, kDefaultTenant).ok());
  step->End(true);
  step.reset();
  now += std::chrono::seconds(11);
  creating.reset();
  busy.reset();
  store.ExpireIdle(now);
  EXPECT_EQ(store.size(), 1u);  // `held` is still held.
  held.reset();
  store.ExpireIdle(now);
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(store.bytes(), 0);
}

TEST(KvStoreTest, AMemoryEndedWhileBeingComputedIsAbortedNotMadeReady) {
  KvStore store(KvOptions{});
  auto model = std::make_shared<FakeModel>();
  auto creating =
      *store.Create(KvKind::kMemory, model, std::make_shared<FakeCache>(), 1, 4, kDefaultTenant);
  store.EndModel(model->spec());
  const Status st = store.MarkReady(creating, 4);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_THAT(st.message(), HasSubstr("unloaded by a reload"));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(store.bytes(), 400);  // Still held by its request...
  creating.reset();
  EXPECT_EQ(store.bytes(), 0);  // ... and given back with it.
}

// Entries are counted by the weights they hold (attnserve_kv_model_entries): two versions of one
// model's weights (a replaced one still held) are counted apart, and a count that reaches 0 says
// so.
TEST(KvStoreTest, EntriesAreCountedByTheWeightsTheyHold) {
  std::vector<std::pair<std::string, int64_t>> reports;
  KvMetricsHooks hooks;
  hooks.on_model_entries = [&reports](const ModelSpec& spec, int64_t entries) {
    reports.emplace_back(spec.weights_hash, entries);
  };
  KvStore store(KvOptions{}, hooks);
  auto old_weights = std::make_shared<FakeModel>();
  auto new_weights = std::make_shared<FakeModel>();
  new_weights->spec_.weights_hash = "sha256:bb";
  auto a = NewMemory(store, old_weights, 1);
  auto s = store.Create(KvKind::kSession, old_weights, std::make_shared<FakeCache>(), 1, 0,
                        kDefaultTenant);
  ASSERT_TRUE(s.ok());
  auto b = NewMemory(store, new_weights, 1);
  using R = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(reports, (R{{"sha256:aa", 1}, {"sha256:aa", 2}, {"sha256:bb", 1}}));
  reports.clear();
  ASSERT_TRUE(store.Release(a->handle, KvKind::kMemory, kDefaultTenant).ok());
  ASSERT_TRUE(store.Release((*s)->handle, KvKind::kSession, kDefaultTenant).ok());
  EXPECT_EQ(reports, (R{{"sha256:aa", 1}, {"sha256:aa", 0}}));
  reports.clear();
  store.EndModel(new_weights->spec());
  EXPECT_EQ(reports, (R{{"sha256:bb", 0}}));
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
  ASSERT_TRUE(store.Lookup(fresh_handle, KvKind::kMemory, kDefaultTenant).ok());  // renewed now
  // 61 s on, both were last used more than 60 s before: both expire.
  store.ExpireIdle(KvClock::now() + std::chrono::seconds(61));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(counts.ended("memory expired"), 2);
  EXPECT_THAT(store.Lookup(old_handle, KvKind::kMemory, kDefaultTenant).status().message(),
              HasSubstr("expired"));
  // A reload that unloads the model version ends its entries, saying so.
  auto kept = NewMemory(store, model, 1);
  const std::string kept_handle = kept->handle;
  kept.reset();
  store.EndModel(model->spec());
  auto ended = store.Lookup(kept_handle, KvKind::kMemory, kDefaultTenant);
  ASSERT_FALSE(ended.ok());
  EXPECT_THAT(ended.status().message(), HasSubstr("unloaded by a reload"));
  EXPECT_EQ(counts.memories, 0);
  EXPECT_EQ(counts.bytes, 0);
  EXPECT_EQ(counts.ended("memory unloaded"), 1);
  // Shutdown ends what is left, counted as such.
  auto s =
      store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, kDefaultTenant);
  ASSERT_TRUE(s.ok());
  s->reset();
  store.Clear("the server is shutting down");
  EXPECT_EQ(counts.ended("session shutdown"), 1);
  EXPECT_EQ(counts.ends.size(), 3u);
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// A batched step's sessions are begun together: every one named is busy before any reserves, so
// reserving room for one evicts none of the same call (a step on each session in turn, BeginStep
// then Reserve, evicted the call's own next session here: it was idle and least recently used);
// a handle named twice, unknown or another tenant's is refused alone.
TEST(KvStoreTest, BeginStepsMarksEverySessionOfACallBusyBeforeAnyReserves) {
  Counts counts;
  KvOptions o;
  o.budget_bytes = 4000;
  KvStore store(o, HooksInto(&counts));
  auto model = std::make_shared<FakeModel>();
  std::vector<std::string> h;
  for (int i = 0; i < 3; ++i) {
    auto s = store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, "t");
    ASSERT_TRUE(s.ok());
    h.push_back((*s)->handle);
  }
  // Each session holds 16 tokens (1,600 bytes): 4,800 would not fit, so fill two and leave the
  // third empty; the two full ones are now the least recently used.
  for (int i = 0; i < 2; ++i) {
    auto step = store.BeginStep(h[i], 0, "t");
    ASSERT_TRUE(step.ok());
    ASSERT_TRUE((*step)->Reserve(16).ok());
    Compute(**step);
    (*step)->End(true);
  }
  EXPECT_EQ(store.bytes(), 3200);
  auto other = store.Create(KvKind::kSession, model, std::make_shared<FakeCache>(), 1, 0, "u");
  ASSERT_TRUE(other.ok());
  auto begun = store.BeginSteps({{h[2], 0},
                                 {h[0], 16},
                                 {h[1], std::nullopt},
                                 {h[0], 16},
                                 {"0123456789abcdef0123456789abcdef", std::nullopt},
                                 {(*other)->handle, std::nullopt},
                                 {h[1], 3}},
                                "t");
  ASSERT_EQ(begun.size(), 7u);
  for (int i : {0, 1, 2}) ASSERT_TRUE(begun[i].ok()) << begun[i].status().message();
  EXPECT_EQ(begun[3].status().code(), StatusCode::kAborted);  // h[0] again: in flight
  EXPECT_EQ(begun[4].status().code(), StatusCode::kNotFound);
  EXPECT_EQ(begun[5].status().code(), StatusCode::kNotFound);  // u's, for t: never made
  EXPECT_EQ(begun[6].status().code(), StatusCode::kAborted);   // h[1] again
  // h[2]'s 16 tokens need 1,600 more than the 800 free: the others of the call are busy, so the
  // store refuses rather than evict them.
  const Status room = (*begun[0])->Reserve(16);
  EXPECT_EQ(room.code(), StatusCode::kResourceExhausted) << room.message();
  EXPECT_EQ(counts.ended("session evicted"), 0);
  for (int i : {1, 2}) {
    ASSERT_TRUE((*begun[i])->Reserve(1).ok());
    Compute(**begun[i]);
    (*begun[i])->End(true);
  }
  (*begun[0])->End(false);
  EXPECT_EQ(store.Info(*(*begun[1])->entry()).length, 17);
  EXPECT_EQ(store.Info(*(*begun[2])->entry()).length, 17);
  EXPECT_EQ(store.Info(*(*begun[0])->entry()).length, 0);
  EXPECT_EQ(store.Info(*(*begun[0])->entry()).busy, false);
}

}  // namespace
}  // namespace attnserve
