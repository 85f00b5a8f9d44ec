// The keys and values kept between requests as a state machine: random
// operation sequences over a KvStore and the LibTorch engine, every invariant of the reference
// model checked after every operation (tests/lib/kv_model_check.h), the same store driven from
// several threads at once (run under ThreadSanitizer by tools/sanitize.sh), and random calls by
// several tenants, every byte charged to exactly one of them (tests/lib/kv_tenant_check.h).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/kv/kv_store.h"
#include "tests/lib/decoder_reference.h"
#include "tests/lib/kv_model_check.h"
#include "tests/lib/kv_tenant_check.h"
#include "tests/lib/mha_reference.h"
#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

using testing::Choices;
using testing::KvCheckOptions;
using testing::KvCheckStats;
using testing::RunKvModelCheck;

TEST(KvPropertyTest, RandomOperationSequencesKeepEveryInvariant) {
  KvCheckStats stats;
  const HelperPool helpers(2);
  // 1,000 sequences; a quarter under the sanitizers (69 s under ThreadSanitizer with all).
  const int seeds = testing::Repetitions(1000, 4);
  for (uint64_t seed = 1; seed <= static_cast<uint64_t>(seeds); ++seed) {
    std::mt19937_64 rng(seed);
    Choices choices([&rng](uint8_t* b) {
      *b = static_cast<uint8_t>(rng());
      return true;
    });
    KvCheckOptions options;
    options.max_ops = 400;
    options.stats = &stats;
    if (seed % 2 == 0) options.parallel = &helpers;  // Half the runs compute split across threads.
    options.kept_runs = seed % 3 == 0;               // A third on pooled sessions and kept runs.
    const std::string failure = RunKvModelCheck(choices, options);
    if (!failure.empty()) {  // The same sequence again, with the operations that led there.
      std::string log;
      std::mt19937_64 again(seed);
      Choices replay([&again](uint8_t* b) {
        *b = static_cast<uint8_t>(again());
        return true;
      });
      options.log = &log;
      RunKvModelCheck(replay, options);
      FAIL() << "seed " << seed << ": " << failure << "\noperations:\n" << log;
    }
  }
  std::printf("kv property: %s\n", stats.ToString().c_str());
  // Not vacuous: every kind of event happened, many times (100 in 1,000 sequences).
  for (int64_t n :
       {stats.step_answers_checked, stats.steps_not_applied, stats.memory_answers_checked,
        stats.evicted, stats.expired, stats.released, stats.unloaded, stats.invalid,
        stats.not_found, stats.exhausted, stats.aborted, stats.forks, stats.truncations,
        stats.decoder_answers_checked, stats.kept_answers_checked}) {
    EXPECT_GE(n, seeds / 10) << stats.ToString();
  }
}

// ---- several threads on one store ---------------------------------------------------------------
constexpr int64_t kE = 8;

// nn.MultiheadAttention, or a decoder layer (2 query heads on 1 key/value head, RoPE, q/k norms)
// whose kept keys are rotated at their positions and half as wide.
std::unique_ptr<AttentionModel> SmallModel(const char* name, uint32_t seed, bool decoder = false) {
  std::mt19937 rng(seed);
  testing::DecoderShape shape;
  shape.name = name;
  shape.e = kE, shape.h = 2, shape.kvh = 1, shape.qk_norm = true;
  ModelWeights w = decoder ? testing::RandomDecoderWeights(rng, shape)
                           : testing::RandomWeights(rng, name, kE, 2);
  w.spec.weights_hash = std::string("sha256:") + name;
  auto m = CreateTorchModel(w, EngineOptions{});
  EXPECT_TRUE(m.ok()) << m.status().message();
  return std::move(m).value();
}

// One causal self-attention over `tokens` ([L, B, E], sequence-first): its last `t` rows.
std::vector<float> CausalTail(const AttentionModel& m, const std::vector<float>& tokens, int64_t b,
                              int64_t t) {
  const int64_t l = static_cast<int64_t>(tokens.size()) / (b * kE);
  testing::Buffer x = testing::Floats({l, b, kE}, tokens);
  AttendCall whole;
  whole.query = x.view();
  whole.layout = TensorLayout::kSequenceFirst;
  whole.is_causal = true;
  EXPECT_TRUE(Validate(m.spec(), {}, &whole).ok());
  std::string out;
  AttendOutputs o;
  o.output = &out;
  EXPECT_TRUE(m.Forward(whole, &o).ok());
  const float* f = reinterpret_cast<const float*>(out.data());
  return std::vector<float>(f + (l - t) * b * kE, f + l * b * kE);
}

// A step the way the service runs one: BeginStep, validation against the session's length, Reserve,
// compute, End. The answer ([T, B, E]) when computed; `code` and `message` say what stopped it.
struct StepResult {
  StatusCode code = StatusCode::kOk;
  std::string message;
  int64_t length = 0;  // Before the step.
  bool applied = false;
  std::vector<float> answer;
};
StepResult Step(KvStore& store, const AttentionModel& model, const std::string& handle,
                std::optional<int64_t> expected, int64_t b, const std::vector<float>& tokens,
                bool apply, const std::string& tenant = kDefaultTenant) {
  StepResult r;
  auto begun = store.BeginStep(handle, expected, tenant);
  if (!begun.ok()) {
    r.code = begun.status().code();
    r.message = begun.status().message();
    return r;
  }
  std::unique_ptr<KvStep> step = std::move(*begun);
  r.length = step->length();
  const int64_t t = static_cast<int64_t>(tokens.size()) / (b * kE);
  testing::Buffer q = testing::Floats({t, b, kE}, tokens);
  AttendCall call;
  call.query = q.view();
  call.layout = TensorLayout::kSequenceFirst;
  call.is_causal = true;
  call.kv_use = AttendCall::Kv::kSession;
  call.kv = step->entry()->cache;
  call.kv_batch = step->entry()->batch;
  call.kv_length = step->length();
  Status st = Validate(model.spec(), {}, &call);
  if (st.ok()) st = step->Reserve(call.query_len);
  if (st.ok()) {
    call.kv_capacity = step->capacity();
    std::string out;
    AttendOutputs o;
    o.output = &out;
    st = model.Forward(call, &o);
    const float* f = reinterpret_cast<const float*>(out.data());
    if (st.ok()) r.answer.assign(f, f + out.size() / sizeof(float));
  }
  r.code = st.code();
  r.message = st.message();
  r.applied = st.ok() && apply;
  step->End(r.applied);
  return r;
}

// Four threads open, step (their own sessions, and one session all of them race on), create, query
// and release memories on one store, while another ticks the store's clock (expiry), unloads a
// model and reads snapshots; model "b" is a decoder layer (rotated keys, grouped heads). Each
// applied step's answer equals one causal call over its session's applied tokens; the shared
// session's applied steps tile it without gaps or overlaps; no gauge is ever negative or over the
// budget; every entry's bytes are its capacity's; at the end, bytes held = the sum over the
// entries, and nothing once they are cleared.
TEST(KvPropertyTest, ThreadsSharingOneStoreKeepItsAccountsAndAnswers) {
  const std::shared_ptr<AttentionModel> models[2] = {SmallModel("a", 11),
                                                     SmallModel("b", 12, true)};
  KvOptions o;
  o.budget_bytes = 160 << 10;
  o.max_entry_bytes = 64 << 10;
  o.max_entries = 24;
  o.ttl_seconds = 30;
  std::atomic<int64_t> now_ns{int64_t{3600} * 1000000000};
  std::atomic<bool> negative{false}, over_budget{false};
  std::atomic<int64_t> gauge{0};
  KvMetricsHooks hooks;
  hooks.on_size = [&](int64_t b, int64_t m, int64_t s) {
    gauge = b;
    if (b < 0 || m < 0 || s < 0) negative = true;
    if (b > o.budget_bytes) over_budget = true;
  };
  KvStore store(o, hooks,
                [&] { return KvClock::time_point(std::chrono::nanoseconds(now_ns.load())); });
  auto shared =
      store.Create(KvKind::kSession, models[0], models[0]->NewKvCache(), 1, 0, kDefaultTenant);
  ASSERT_TRUE(shared.ok());
  const std::string shared_handle = (*shared)->handle;
  shared->reset();

  struct Applied {
    int64_t begin;
    std::vector<float> tokens, answer;
  };
  std::mutex mu;
  std::vector<Applied> shared_steps;
  std::vector<Applied> fork_steps;  // A fork of the shared session, one step: begin = its length.
  std::atomic<int64_t> forks{0};
  std::map<std::string, int> failures;  // What went wrong, by message.
  std::atomic<int64_t> applied{0}, checked{0}, not_found{0}, aborted{0}, exhausted{0};
  const auto fail = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    ++failures[what];
  };
  std::atomic<int> running{4};
  std::vector<std::thread> threads;
  for (int id = 0; id < 4; ++id) {
    threads.emplace_back([&, id] {
      std::mt19937_64 rng(900 + id);
      struct Mine {
        std::string handle;
        int model = 0;
        int64_t batch = 1;
        std::vector<float> tokens;
      };
      std::optional<Mine> mine;
      const auto fresh = [&rng](int64_t n) {
        std::mt19937 g(static_cast<uint32_t>(rng()));
        return testing::RandomFloats(g, static_cast<size_t>(n));
      };
      std::vector<std::shared_ptr<KvEntry>> holds;
      for (int iter = 0; iter < 1500; ++iter) {
        const uint64_t op = rng() % 8;
        if (op == 0 && !mine) {
          Mine m;
          m.model = static_cast<int>(rng() % 2);
          m.batch = 1 + static_cast<int64_t>(rng() % 2);
          auto e = store.Create(KvKind::kSession, models[m.model], models[m.model]->NewKvCache(),
                                m.batch, 0, kDefaultTenant);
          if (e.ok()) {
            m.handle = (*e)->handle;
            mine = m;
          } else if (e.status().code() == StatusCode::kResourceExhausted) {
            ++exhausted;
          } else {
            fail("OpenSession: " + e.status().message());
          }
        } else if (op <= 2 && mine) {
          const int64_t t = 1 + static_cast<int64_t>(rng() % 3);
          const std::vector<float> x = fresh(t * mine->batch * kE);
          const int64_t length = static_cast<int64_t>(mine->tokens.size()) / (mine->batch * kE);
          const bool apply = rng() % 4 != 0;
          StepResult r =
              Step(store, *models[mine->model], mine->handle, length, mine->batch, x, apply);
          if (r.code == StatusCode::kNotFound) {
            ++not_found;  // Evicted, expired or unloaded: another thread's doing.
            if (r.message.find("evicted") == std::string::npos &&
                r.message.find("expired") == std::string::npos &&
                r.message.find("unloaded") == std::string::npos) {
              fail("own session: " + r.message);
            }
            mine.reset();
          } else if (r.code == StatusCode::kResourceExhausted) {
            ++exhausted;
          } else if (r.code != StatusCode::kOk) {
            fail("own step: " + r.message);  // Only this thread steps it, at its length.
          } else if (r.applied) {
            ++applied;
            mine->tokens.insert(mine->tokens.end(), x.begin(), x.end());
            const double err = testing::RelativeError(
                std::string(reinterpret_cast<const char*>(r.answer.data()),
                            r.answer.size() * sizeof(float)),
                CausalTail(*models[mine->model], mine->tokens, mine->batch, t));
            ++checked;
            if (err > 1e-5)
              fail("a step's answer differs from one causal call by " + std::to_string(err));
            if (mine->tokens.size() >= static_cast<size_t>(24 * mine->batch * kE)) {
              store.Release(mine->handle, KvKind::kSession, kDefaultTenant);
              mine.reset();
            }
          }
        } else if (op == 3) {  // The session every thread races on.
          const std::vector<float> x = fresh(kE);
          StepResult r = Step(store, *models[0], shared_handle, std::nullopt, 1, x, true);
          if (r.code == StatusCode::kAborted) {
            ++aborted;
          } else if (r.code == StatusCode::kOk) {
            std::lock_guard<std::mutex> lock(mu);
            shared_steps.push_back({r.length, x, r.answer});
          } else if (r.code != StatusCode::kNotFound && r.code != StatusCode::kResourceExhausted &&
                     r.message.find("--kv-max-entry-bytes") == std::string::npos) {
            fail("shared step: " + r.message);
          }
        } else if (op == 4) {  // A memory: created, computed, queried (and held, sometimes).
          const int m = static_cast<int>(rng() % 2);
          const int64_t lk = 1 + static_cast<int64_t>(rng() % 6);
          testing::Buffer kv = testing::Floats({1, lk, kE}, fresh(lk * kE));
          AttendCall create;
          create.key = kv.view();
          create.value = kv.view();
          if (!ValidateCreateMemory(models[m]->spec(), {}, &create).ok())
            fail("memory does not validate");
          auto e = store.Create(KvKind::kMemory, models[m], models[m]->NewKvCache(), 1, lk,
                                kDefaultTenant);
          if (!e.ok()) {
            if (e.status().code() != StatusCode::kResourceExhausted)
              fail("CreateMemory: " + e.status().message());
            continue;
          }
          create.kv = (*e)->cache;
          std::string none;
          AttendOutputs out;
          out.output = &none;
          if (!models[m]->Forward(create, &out).ok()) fail("engine: CreateMemory");
          const Status ready = store.MarkReady(*e, lk);
          if (!ready.ok()) {
            if (ready.message().find("unloaded") == std::string::npos)
              fail("MarkReady: " + ready.message());
            continue;
          }
          if (rng() % 3 == 0) holds.push_back(*e);  // A request still using it...
          if (rng() % 8 != 0)
            store.Release((*e)->handle, KvKind::kMemory,
                          kDefaultTenant);  // ... when it is deleted.
        } else if (op == 5 && !holds.empty()) {
          holds.erase(holds.begin());
        } else if (op == 7 && rng() % 2 == 0) {
          // A fork of the session every thread steps: it shares what the session holds at that
          // moment (ABORTED while a step is in flight), and its own step must see exactly that,
          // whatever the session's later steps write.
          auto fork = store.Fork(shared_handle, models[0]->NewKvCache(), kDefaultTenant);
          if (fork.ok()) {
            ++forks;
            const std::string handle = (*fork)->handle;
            const int64_t length = (*fork)->length;
            fork->reset();
            const std::vector<float> x = fresh(kE);
            StepResult r = Step(store, *models[0], handle, length, 1, x, true);
            if (r.code == StatusCode::kOk) {
              std::lock_guard<std::mutex> lock(mu);
              fork_steps.push_back({length, x, r.answer});
            } else if (r.code != StatusCode::kNotFound &&
                       r.code != StatusCode::kResourceExhausted) {
              fail("a fork's step: " + r.message);
            }
            store.Release(handle, KvKind::kSession, kDefaultTenant);
          } else if (fork.status().code() == StatusCode::kAborted) {
            ++aborted;
          } else if (fork.status().code() != StatusCode::kNotFound &&
                     fork.status().code() != StatusCode::kResourceExhausted) {
            fail("fork: " + fork.status().message());
          }
        } else if (op == 6 && mine && rng() % 4 == 0) {
          store.Release(mine->handle, KvKind::kSession, kDefaultTenant);
          mine.reset();
        }
      }
      holds.clear();
      --running;
    });
  }
  // The clock, expiry, a reload now and then, and snapshots: racing the workers.
  std::thread chaos([&] {
    std::mt19937_64 rng(77);
    while (running > 0) {
      now_ns += static_cast<int64_t>(rng() % 1000) * 1000000;  // Up to 1 s a millisecond.
      store.ExpireIdle(KvClock::time_point(std::chrono::nanoseconds(now_ns.load())));
      if (rng() % 200 == 0) store.EndModel(models[1]->spec());
      // A step in flight that outgrew a block forks still read holds both until it ends (the
      // budget counts the replaced one): up to twice the entry limit while busy.
      for (const KvEntryInfo& e : store.Snapshot()) {
        if (e.bytes < 0 || e.bytes > (e.busy ? 2 : 1) * o.max_entry_bytes ||
            (e.kind == KvKind::kSession && e.capacity < e.length)) {
          fail("snapshot: an entry with " + std::to_string(e.bytes) + " bytes, capacity " +
               std::to_string(e.capacity) + ", length " + std::to_string(e.length) +
               (e.busy ? ", a step in flight" : ", no step in flight"));
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  for (auto& t : threads) t.join();
  chaos.join();

  for (const auto& [what, n] : failures) ADD_FAILURE() << what << " (" << n << " times)";
  EXPECT_FALSE(negative);
  EXPECT_FALSE(over_budget);
  // The shared session: applied steps tile it in order, and each answered what one causal call
  // over the steps before it and itself answers.
  std::sort(shared_steps.begin(), shared_steps.end(),
            [](const Applied& a, const Applied& b) { return a.begin < b.begin; });
  std::vector<float> sequence;
  for (const Applied& a : shared_steps) {
    ASSERT_EQ(static_cast<int64_t>(sequence.size()) / kE, a.begin)
        << "a gap or an overlap in the shared session";
    sequence.insert(sequence.end(), a.tokens.begin(), a.tokens.end());
    const std::vector<float> want = CausalTail(*models[0], sequence, 1, 1);
    EXPECT_LE(
        testing::RelativeError(
            std::string(reinterpret_cast<const char*>(a.answer.data()), a.answer.size() * 4), want),
        1e-5);
  }
  // Each fork's step: one causal call over the shared session's first `begin` tokens and its own.
  for (const Applied& f : fork_steps) {
    ASSERT_LE(f.begin * kE, static_cast<int64_t>(sequence.size()));
    std::vector<float> mine(sequence.begin(), sequence.begin() + f.begin * kE);
    mine.insert(mine.end(), f.tokens.begin(), f.tokens.end());
    EXPECT_LE(testing::RelativeError(
                  std::string(reinterpret_cast<const char*>(f.answer.data()), f.answer.size() * 4),
                  CausalTail(*models[0], mine, 1, 1)),
              1e-5)
        << "a fork of " << f.begin << " tokens";
  }
  // Quiescent: bytes held = the gauge, at least the sum over the entries (blocks forks shared
  // count on their own once their session let go of them); cleared, nothing.
  int64_t sum = 0;
  for (const KvEntryInfo& e : store.Snapshot()) sum += e.bytes;
  EXPECT_GE(store.bytes(), sum);
  EXPECT_EQ(gauge.load(), store.bytes());
  store.Clear("the test ends");
  EXPECT_EQ(store.bytes(), 0);
  EXPECT_EQ(gauge.load(), 0);
  std::printf(
      "kv threads: %lld own steps applied (%lld answers checked), %zu shared steps, %lld forks "
      "of it (%zu stepped), %lld ABORTED, %lld NOT_FOUND, %lld RESOURCE_EXHAUSTED\n",
      static_cast<long long>(applied.load()), static_cast<long long>(checked.load()),
      shared_steps.size(), static_cast<long long>(forks.load()), fork_steps.size(),
      static_cast<long long>(aborted.load()), static_cast<long long>(not_found.load()),
      static_cast<long long>(exhausted.load()));
  EXPECT_GE(checked.load(), 100);
  EXPECT_GE(shared_steps.size(), 20u);
  EXPECT_GE(fork_steps.size(), 20u);
}

// ---- tenants: every byte kept charged to exactly one tenant -------------------------------------

std::shared_ptr<const Tenants> TenantTerms(const std::string& json) {
  auto t = Tenants::Parse(json, "tenants.json");
  EXPECT_TRUE(t.ok()) << t.status().message();
  return t.ok() ? *t : std::make_shared<Tenants>();
}

// What the store reports (attnserve_tenant_kv_bytes by label, attnserve_kv_bytes), and what must
// hold of it after every call.
struct TenantBooks {
  std::map<std::string, int64_t> labels;
  int64_t gauge = 0;
  KvMetricsHooks Hooks() {
    KvMetricsHooks h;
    h.on_size = [this](int64_t bytes, int64_t, int64_t) { gauge = bytes; };
    h.on_tenant_bytes = [this](const std::string& label, int64_t bytes) { labels[label] = bytes; };
    return h;
  }
  // "" when every byte the store holds is charged to exactly one of `tenants` (their bytes, and
  // the labels', add up to the store's and its gauge's), none over its cap, the store within its
  // budget; else what broke.
  std::string Check(const KvStore& store, const Tenants& terms,
                    const std::vector<std::string>& tenants) const {
    std::string broken;
    int64_t sum = 0, labelled = 0;
    for (const std::string& t : tenants) {
      const int64_t mine = store.TenantBytes(t), cap = terms.Of(t).kv_max_bytes;
      sum += mine;
      if (mine < 0 || (cap > 0 && mine > cap)) {
        broken += "tenant '" + t + "' holds " + std::to_string(mine) + " bytes, cap " +
                  std::to_string(cap) + "; ";
      }
    }
    for (const auto& [label, bytes] : labels) labelled += bytes;
    const int64_t held = store.bytes();
    if (sum != held || labelled != held || gauge != held || held > store.options().budget_bytes) {
      broken += "the store holds " + std::to_string(held) + " bytes (gauge " +
                std::to_string(gauge) + ", budget " + std::to_string(store.options().budget_bytes) +
                "), the tenants " + std::to_string(sum) + ", their labels " +
                std::to_string(labelled);
    }
    return broken;
  }
};

// Open a session, fill it, fork it and close it, six times, as a tenant capped at 2,000,000
// bytes: the closed sessions' blocks, which their forks still read, stay charged to that tenant,
// so it never holds more than its cap (the fill that would pass it is refused, naming the cap),
// and the tenants' bytes add up to the store's after every call. Another tenant, within its
// guarantee, then gets room the forks kept: evicting them frees the blocks.
TEST(KvTenantPropertyTest, ForksOfClosedSessionsStayChargedToTheirTenant) {
  const std::shared_ptr<AttentionModel> model = SmallModel("t", 21);
  KvOptions o;
  o.budget_bytes = 4000000;
  o.max_entry_bytes = 3000000;
  TenantBooks books;
  KvClock::time_point now{std::chrono::hours(1)};
  KvStore store(o, books.Hooks(), [&now] { return now; });
  const auto terms = TenantTerms(R"({"tenants": {"a": {"kv_max_bytes": 2000000},
      "b": {"kv_guaranteed_bytes": 3000000}}})");
  store.SetTenants(terms);
  const std::vector<std::string> tenants{"a", "b", kDefaultTenant};
  const auto check = [&](const std::string& after) {
    EXPECT_EQ(books.Check(store, *terms, tenants), "") << "after " << after;
  };
  // 68 bytes a token of one sequence (2 x 8 floats and the key padding): 408,000 a session.
  constexpr int64_t kBatch = 10, kTokens = 600;
  std::mt19937 rng(5);
  std::vector<std::string> forks;
  int capped = 0;
  for (int round = 0; round < 6; ++round) {
    const std::string r = " " + std::to_string(round);
    now += std::chrono::seconds(1);
    auto parent = store.Create(KvKind::kSession, model, model->NewKvCache(), kBatch, 0, "a");
    ASSERT_TRUE(parent.ok()) << parent.status().message();
    const std::string p = (*parent)->handle;
    parent->reset();
    check("open" + r);
    const StepResult fill = Step(store, *model, p, 0, kBatch,
                                 testing::RandomFloats(rng, kBatch * kTokens * kE), true, "a");
    if (fill.code == StatusCode::kResourceExhausted) {
      ++capped;
      EXPECT_NE(fill.message.find("over its kv_max_bytes 2000000"), std::string::npos)
          << fill.message;
    } else {
      ASSERT_EQ(fill.code, StatusCode::kOk) << fill.message;
    }
    check("fill" + r);
    auto fork = store.Fork(p, model->NewKvCache(), "a");
    ASSERT_TRUE(fork.ok()) << fork.status().message();
    forks.push_back((*fork)->handle);
    fork->reset();
    check("fork" + r);
    ASSERT_TRUE(store.Release(p, KvKind::kSession, "a").ok());
    check("close" + r);
  }
  EXPECT_EQ(capped, 2);  // 4 x 408,000 held; a fifth would pass 2,000,000.
  EXPECT_EQ(store.TenantBytes("a"), 4 * 408000);
  // b needs 2,992,000 of the 4,000,000 and a keeps 1,632,000 without a guarantee: the least
  // recently made forks go, and with them the blocks of the sessions they were forked from.
  auto big = store.Create(KvKind::kMemory, model, model->NewKvCache(), kBatch, 4400, "b");
  ASSERT_TRUE(big.ok()) << big.status().message();
  ASSERT_TRUE(store.MarkReady(*big, 4400).ok());
  check("b's memory");
  EXPECT_EQ(store.TenantBytes("b"), 2992000);
  EXPECT_EQ(store.TenantBytes("a"), 2 * 408000);
  for (size_t i = 0; i < forks.size(); ++i) {
    EXPECT_EQ(store.Lookup(forks[i], KvKind::kSession, "a").ok(), i >= 2) << "fork " << i;
  }
  big->reset();
  store.Clear("the test ends");
  check("clear");
  EXPECT_EQ(store.bytes(), 0);
}

// Closing a session whose fork still reads its block moves the block's bytes from the session to
// the family in one change: every value the gauges report on the way lies between what was held
// before and what is held after. Before, the session's bytes went first and the tenant's gauge (and
// the store's) read 0 until its cache handed the block over: a scrape in between saw memory held
// that no count held (isolation_test.py failed so under CI's load), and an allocation then could
// pass the budget; the family's charge first would count the block twice, over a cap.
TEST(KvTenantPropertyTest, ClosingAForkedSessionNeverReportsItsSharedBlockAsFree) {
  const std::shared_ptr<AttentionModel> model = SmallModel("t", 22);
  std::vector<int64_t> tenant_reports, size_reports;
  KvMetricsHooks hooks;
  hooks.on_size = [&](int64_t bytes, int64_t, int64_t) { size_reports.push_back(bytes); };
  hooks.on_tenant_bytes = [&](const std::string& label, int64_t bytes) {
    if (label == "a") tenant_reports.push_back(bytes);
  };
  KvStore store(KvOptions{}, hooks);
  store.SetTenants(TenantTerms(R"({"tenants": {"a": {}}})"));
  std::mt19937 rng(6);
  auto parent = store.Create(KvKind::kSession, model, model->NewKvCache(), 2, 0, "a");
  ASSERT_TRUE(parent.ok()) << parent.status().message();
  const std::string p = (*parent)->handle;
  parent->reset();
  ASSERT_EQ(Step(store, *model, p, 0, 2, testing::RandomFloats(rng, 2 * 50 * kE), true, "a").code,
            StatusCode::kOk);
  auto fork = store.Fork(p, model->NewKvCache(), "a");
  ASSERT_TRUE(fork.ok()) << fork.status().message();
  fork->reset();
  tenant_reports.clear();
  size_reports.clear();
  const int64_t before = store.TenantBytes("a");
  ASSERT_TRUE(store.Release(p, KvKind::kSession, "a").ok());
  const int64_t held = store.TenantBytes("a");
  ASSERT_GT(held, 0) << "the fork reads the closed session's block: it stays charged";
  EXPECT_EQ(store.bytes(), held);
  ASSERT_FALSE(tenant_reports.empty());
  EXPECT_EQ(tenant_reports.back(), held);
  for (const int64_t r : tenant_reports) {
    EXPECT_GE(r, held) << "tenant a's gauge dipped";
    EXPECT_LE(r, before) << "tenant a's gauge counted the block twice";
  }
  for (const int64_t r : size_reports) {
    EXPECT_GE(r, held) << "the store's gauge dipped";
    EXPECT_LE(r, before) << "the store's gauge counted the block twice";
  }
}

// Random calls by four tenants on one store over the LibTorch engine (two capped, three with
// guarantees, one the tenants file does not name), batched steps among them (their entries mixing
// the caller's sessions, other tenants' handles and names given twice), every invariant checked
// after every call
// (tests/lib/kv_tenant_check.h): eight seeds of 1,500 calls.
TEST(KvTenantPropertyTest, RandomCallsChargeEveryByteToExactlyOneTenant) {
  std::map<std::string, int64_t> seen;  // What happened, so the test is not vacuous.
  for (uint32_t seed = 1; seed <= 8; ++seed) {
    std::mt19937_64 rng(seed);
    const std::function<uint8_t()> byte = [&rng] { return static_cast<uint8_t>(rng()); };
    testing::KvTenantMachine machine;
    std::string broken;
    for (int op = 0; op < 1500 && broken.empty(); ++op) broken = machine.Step(byte);
    if (broken.empty()) broken = machine.End();
    if (!broken.empty()) {  // The same calls again, with the operations that led there.
      std::string log;
      testing::KvTenantOptions options;
      options.log = &log;
      std::mt19937_64 again(seed);
      const std::function<uint8_t()> replay = [&again] { return static_cast<uint8_t>(again()); };
      testing::KvTenantMachine twin(options);
      for (int op = 0; op < 1500 && twin.Step(replay).empty(); ++op) {
      }
      FAIL() << "seed " << seed << ": " << broken << "\noperations:\n" << log;
    }
    for (const auto& [what, n] : machine.seen()) seen[what] += n;
  }
  std::string summary;
  for (const auto& [what, n] : seen) summary += what + " " + std::to_string(n) + ", ";
  std::printf("kv tenants: %s\n", summary.c_str());
  for (const char* what :
       {"forks", "invalid", "refused room", "refused room, nothing held", "capped",
        "evicted for another tenant", "holds let go", "blocks kept by forks alone",
        "probes of open handles", "probes of ended handles", "batched: steps",
        "batched: another tenant's handle", "batched: a handle never made",
        "batched: named again"}) {
    EXPECT_GE(seen[what], 10) << what << "; " << summary;
  }
}

}  // namespace
}  // namespace attnserve
