#include "tests/lib/kv_model_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "server/core/checked_math.h"
#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/kv/kv_store.h"
#include "tests/lib/decoder_reference.h"
#include "tests/lib/mha_reference.h"

namespace attnserve::testing {

uint8_t Choices::Byte() {
  uint8_t b = 0;
  if (!exhausted_ && !next_(&b)) {
    exhausted_ = true;
    b = 0;
  }
  return b;
}

uint64_t Choices::Below(uint64_t n) {
  if (n <= 1) return 0;
  uint64_t v = Byte();
  if (n > 256) {
    for (int i = 1; i < 8; ++i) v = (v << 8) | Byte();
  }
  return v % n;
}

int64_t Choices::Size(int64_t small) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(),
                    kMin = std::numeric_limits<int64_t>::min();
  static constexpr int64_t kEdges[] = {0,
                                       1,
                                       -1,
                                       kMin,
                                       kMax,
                                       kMax - 1,
                                       int64_t{1} << 62,
                                       (int64_t{1} << 62) - 3,
                                       int64_t{1} << 61,
                                       int64_t{1} << 31,
                                       (int64_t{1} << 32) + 1,
                                       -(int64_t{1} << 62),
                                       kMax / 2 + 1,
                                       65536,
                                       65537,
                                       kMin + 1};
  const uint8_t kind = Byte();
  if (kind < 192) return static_cast<int64_t>(Below(static_cast<uint64_t>(small) + 1));
  if (kind < 224) return kEdges[Below(std::size(kEdges))];
  if (kind < 240) {
    const int64_t p = int64_t{1} << Below(63);
    return kind & 1 ? -p : p;
  }
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | Byte();
  return static_cast<int64_t>(v);
}

std::string KvCheckStats::ToString() const {
  return std::to_string(operations) + " operations: steps " + std::to_string(steps_applied) +
         " applied (" + std::to_string(step_answers_checked) + " answers checked), " +
         std::to_string(steps_not_applied) + " not; " + std::to_string(forks) + " forks, " +
         std::to_string(truncations) + " truncations; memories " +
         std::to_string(memories_computed) + " computed (" +
         std::to_string(memory_answers_checked) + " answers checked); decoder answers checked " +
         std::to_string(decoder_answers_checked) + ", in kept runs " +
         std::to_string(kept_answers_checked) + "; ends: " + std::to_string(evicted) +
         " evicted, " + std::to_string(expired) + " expired, " + std::to_string(released) +
         " released, " + std::to_string(unloaded) +
         " unloaded; refusals: " + std::to_string(invalid) + " INVALID_ARGUMENT, " +
         std::to_string(not_found) + " NOT_FOUND, " + std::to_string(exhausted) +
         " RESOURCE_EXHAUSTED, " + std::to_string(aborted) + " ABORTED";
}

namespace {

constexpr int64_t kE = 8, kH = 2;
constexpr int kModels = 3;
constexpr int64_t kMaxRealTokens =
    48;  // Answers are checked while a session holds at most this many.

// Three small models on the CPU, made once for the process: two nn.MultiheadAttention ("a", "b")
// and a decoder layer ("c": 2 query heads on 1 key/value head of 4, RoPE, q/k RMSNorm, q and k
// biases), whose kept keys are rotated and half as wide. `kept`: the same under
// EngineOptions::Varlen::kEmulate, sessions in a pool of 2 KiB chunks and batched steps in kept
// runs (the CUDA engine's layout).
std::vector<std::shared_ptr<const AttentionModel>> MakeModels(bool kept) {
  std::vector<std::shared_ptr<const AttentionModel>> out;
  std::mt19937 rng(1717);
  for (const char* name : {"a", "b", "c"}) {
    ModelWeights w;
    if (name[0] == 'c') {
      DecoderShape shape;
      shape.name = name;
      shape.e = kE, shape.h = kH, shape.kvh = 1;
      shape.q_bias = shape.k_bias = shape.qk_norm = true;
      w = RandomDecoderWeights(rng, shape);
    } else {
      w = RandomWeights(rng, name, kE, kH);
    }
    w.spec.weights_hash = std::string("sha256:") + name;
    EngineOptions options;
    options.min_piece_flops =
        0;  // Split as finely as a Parallel allows (KvCheckOptions::parallel).
    if (kept) {
      options.varlen = EngineOptions::Varlen::kEmulate;
      options.kv_pool_chunk_bytes = 2 << 10;
    }
    auto m = CreateTorchModel(w, options);
    if (!m.ok()) {
      std::fprintf(stderr, "kv model check: %s\n", m.status().message().c_str());
      std::abort();
    }
    out.push_back(std::move(m).value());
  }
  return out;
}

const std::shared_ptr<const AttentionModel>* Models(bool kept) {
  static const std::vector<std::shared_ptr<const AttentionModel>> plain = MakeModels(false);
  static const std::vector<std::shared_ptr<const AttentionModel>> pooled = MakeModels(true);
  return kept ? pooled.data() : plain.data();
}

// Deterministic, varied token values in [-1, 1).
std::vector<float> Values(uint64_t seed, size_t n) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& f : v) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    f = static_cast<float>(static_cast<double>(x >> 11) / 4503599627370496.0 - 1.0);
  }
  return v;
}

// [t, b, E] -> [b, t, E].
std::vector<float> BatchFirst(const std::vector<float>& x, int64_t t, int64_t b) {
  std::vector<float> out(x.size());
  for (int64_t i = 0; i < t; ++i)
    for (int64_t bb = 0; bb < b; ++bb)
      std::copy_n(x.begin() + (i * b + bb) * kE, kE, out.begin() + (bb * t + i) * kE);
  return out;
}

// What the reference model says one entry is.
struct Ref {
  std::string handle;
  KvKind kind = KvKind::kSession;
  int model = 0;
  // Its engine cache, held by the store's entry (and by a request using it): the reference must
  // not keep it alive, or an entry the store ends would keep its blocks past their count.
  std::weak_ptr<KvCache> cache;
  std::shared_ptr<KvCache> made;  // The new cache, until the store holds it.
  int64_t batch = 0, length = 0, capacity = 0, bytes = 0;
  int64_t allocated = 0;  // Tokens the engine allocated in the cache.
  bool ready = false, busy = false, indexed = true;
  int holders = 0;       // shared_ptrs the operations in flight hold.
  uint64_t touched = 0;  // LRU order: larger is more recent.
  KvClock::time_point last_use;
  std::string gone;               // Once removed: what its NOT_FOUND says.
  bool real = false;              // Its contents came from the engine (answers can be checked).
  std::vector<float> tokens;      // A session's applied tokens, sequence-first [L, B, E].
  std::vector<float> key, value;  // A memory's inputs, batch-first [B, Lk, E].
  // A session's storage as the engine lays it out (README: forks share, nothing is copied): its
  // first `base` tokens in shared blocks `segs` (block, rows), the rest in its own block `own`
  // (-1: none) of own_rows rows, whose first `frozen` rows forks read.
  std::vector<std::pair<int, int64_t>> segs;
  int own = -1;
  int64_t own_rows = 0, base = 0, frozen = 0;
  bool destroyed = false;  // No one holds it any more: its cache is gone.
  // Its session family (the store's KvFamily): that of the session it was forked from, else its
  // own index.
  size_t family = SIZE_MAX;
  bool in_use() const { return busy || !ready || holders > 0; }
  bool counted() const { return indexed || holders > 0; }
};

// One allocation of a session's keys and values, as the reference counts it: `holders` sessions
// read it (its owner among them); once its owner let go of it while forks still read it, it
// counts itself (`self`) until the last of them goes.
struct Block {
  int64_t bytes = 0;
  int holders = 0;
  bool self = false;
  size_t family = SIZE_MAX;  // The family of the session that allocated it.
};

// Past this many shared blocks a session's step copies its history into one block (TorchKv).
constexpr size_t kMaxShared = 8;

// A handle as the log names it: 6 of its random digits (the first 8 name the replica).
std::string Short(const std::string& handle) {
  return handle.size() >= 14 ? handle.substr(8, 6) : handle;
}

struct Flight {  // A session step in flight.
  std::unique_ptr<KvStep> step;
  size_t ref = 0;
  bool reserved = false, real = false;
  int64_t tokens = 0;
  bool seq_first = false;
  Buffer query;
  std::vector<float> new_tokens;  // [T, B, E] sequence-first
  AttendCall call;
};

struct Creating {  // A memory being computed.
  std::shared_ptr<KvEntry> entry;
  size_t ref = 0;
  Buffer key, value;
  AttendCall call;
};

struct Hold {  // A request holding a memory.
  std::shared_ptr<KvEntry> entry;
  size_t ref = 0;
};

class ModelCheck {
 public:
  ModelCheck(Choices& c, const KvCheckOptions& o) : c_(c), o_(o), models_(Models(o.kept_runs)) {
    options_.budget_bytes = int64_t{1} << (10 + c_.Below(8));
    options_.max_entry_bytes = std::max<int64_t>(1, options_.budget_bytes >> c_.Below(3));
    options_.max_entries = 1 + static_cast<int64_t>(c_.Below(12));
    options_.ttl_seconds = static_cast<double>(1 + c_.Below(60));
    KvMetricsHooks hooks;
    hooks.on_size = [this](int64_t b, int64_t m, int64_t s) {
      gauge_bytes_ = b, gauge_memories_ = m, gauge_sessions_ = s;
      if (b < 0 || m < 0 || s < 0) negative_ = true;
    };
    hooks.on_end = [this](KvKind kind, KvEndReason why) { ++ends_[{kind, why}]; };
    store_ = std::make_unique<KvStore>(options_, hooks, [this] { return now_; });
    Note([&] {
      return std::string("store: budget " + std::to_string(options_.budget_bytes) + ", entry " +
                         std::to_string(options_.max_entry_bytes) + ", entries " +
                         std::to_string(options_.max_entries) + ", ttl " +
                         std::to_string(static_cast<int>(options_.ttl_seconds)));
    });
  }

  ~ModelCheck() {
    if (o_.stats) {
      KvCheckStats& s = *o_.stats;
      s.operations += stats_.operations;
      s.steps_applied += stats_.steps_applied, s.steps_not_applied += stats_.steps_not_applied;
      s.step_answers_checked += stats_.step_answers_checked;
      s.memories_computed += stats_.memories_computed,
          s.memory_answers_checked += stats_.memory_answers_checked;
      s.decoder_answers_checked += stats_.decoder_answers_checked;
      s.evicted += stats_.evicted, s.expired += stats_.expired, s.released += stats_.released;
      s.unloaded += stats_.unloaded, s.invalid += stats_.invalid, s.not_found += stats_.not_found;
      s.exhausted += stats_.exhausted, s.aborted += stats_.aborted;
      s.forks += stats_.forks, s.truncations += stats_.truncations;
    }
    // Operations in flight end before the store goes (the server drains its batcher first), and the
    // store (whose hooks write here) before the rest of this.
    flights_.clear();
    creating_.clear();
    holds_.clear();
    store_.reset();
  }

  std::string Run() {
    for (int i = 0; i < o_.max_ops && !c_.exhausted() && failure_.empty(); ++i) {
      removed_now_.clear();
      ++stats_.operations;
      // Weighted so that sessions live long enough to take many steps.
      const uint64_t op = c_.Below(32);
      if (op < 3)
        OpenSession();
      else if (op < 5)
        CreateMemory(false);
      else if (op < 6)
        CreateMemory(true);
      else if (op < 8)
        CompleteMemory();
      else if (op < 11)
        BeginStep();
      else if (op < 13)
        BeginSteps();
      else if (op < 18)
        PrepareStep();
      else if (op < 22)
        ComputeSteps();
      else if (op < 23)
        DropStep();
      else if (op < 26)
        QueryMemory();
      else if (op < 27)
        DropHold();
      else if (op < 28)
        Release();
      else if (op < 29)
        Truncate();
      else if (op < 30)
        Fork();
      else if (op < 31)
        Tick();
      else if (c_.OneIn(32))
        EndAll();
      else if (c_.OneIn(4))
        Unload();
      if (failure_.empty()) CheckInvariants();
    }
    return failure_;
  }

 private:
  // ---- bookkeeping ------------------------------------------------------------------------------
  const Parallel& Split() const { return o_.parallel ? *o_.parallel : SerialParallel(); }
  // Log lines and failure messages are made only when used: the fuzzer runs these checks millions
  // of times. A failing input is run again with a log (KvCheckOptions::log).
  template <typename F>
  void Note(F&& line) {
    if (o_.log) *o_.log += line() + "\n";
  }
  void Fail(const std::string& what) {
    if (failure_.empty()) failure_ = what;
  }
  template <typename F>
  bool Expect(bool ok, F&& what) {
    if (!ok) Fail(what());
    return ok;
  }
  void ExpectCode(const Status& got, StatusCode want, const char* op) {
    Count(got.code());
    if (got.code() != want) {
      Fail(std::string(op) + ": " + StatusCodeName(got.code()) + " '" + got.message() +
           "', the reference expects " + StatusCodeName(want));
    }
  }
  // Bytes the budget holds: live entries (and ended ones still held), and the blocks that count
  // themselves.
  int64_t Account() {
    Reap();
    int64_t sum = 0;
    for (const Ref& r : refs_) sum += r.counted() ? r.bytes : 0;
    for (const Block& b : blocks_) sum += b.self && b.holders > 0 ? b.bytes : 0;
    return sum;
  }
  // Entries no one holds any more: their caches go (the store's entry is gone with them), letting
  // go of their blocks.
  void Reap() {
    for (Ref& r : refs_) {
      if (r.counted() || r.destroyed) continue;
      r.destroyed = true;
      for (const auto& [block, rows] : r.segs) --blocks_[static_cast<size_t>(block)].holders;
      r.segs.clear();
      ReleaseOwn(r);
      r.cache.reset();
    }
  }
  // The session lets go of its own block; one that forks read counts itself from now on.
  void ReleaseOwn(Ref& r) {
    if (r.own >= 0) {
      Block& b = blocks_[static_cast<size_t>(r.own)];
      if (r.frozen > 0) b.self = true;
      --b.holders;
    }
    r.own = -1;
    r.own_rows = 0;
    r.frozen = 0;
  }
  int NewBlock(const Ref& r, int64_t rows) {
    blocks_.push_back(Block{BytesFor(r, rows).value_or(-1), 1, false, r.family});
    return static_cast<int>(blocks_.size() - 1);
  }
  // The shared blocks covering the first `tokens` tokens of `r` (those past it dropped, the last
  // cut), each held once more.
  std::vector<std::pair<int, int64_t>> SegsUpTo(const Ref& r, int64_t tokens) {
    std::vector<std::pair<int, int64_t>> kept;
    int64_t at = 0;
    for (const auto& [block, rows] : r.segs) {
      if (at >= tokens) break;
      kept.emplace_back(block, std::min(rows, tokens - at));
      ++blocks_[static_cast<size_t>(block)].holders;
      at += kept.back().second;
    }
    return kept;
  }
  void SetSegs(Ref& r, std::vector<std::pair<int, int64_t>> segs) {
    for (const auto& [block, rows] : r.segs) --blocks_[static_cast<size_t>(block)].holders;
    r.segs = std::move(segs);
  }
  // The engine's plan for a step after `held` tokens (README's fork rules): the tokens it will
  // share, the own tokens it can write on, and whether a replaced own block stays alive.
  struct Plan {
    int64_t shared = 0, own = 0;
    bool retained = false;
  };
  Plan PlanOf(const Ref& r, int64_t held) const {
    Plan p;
    size_t pieces = r.segs.size();
    if (held < r.base) {
      p = Plan{held, 0, r.frozen > 0};
      int64_t at = 0;
      pieces = 0;
      for (const auto& seg : r.segs) {
        if (at >= held) break;
        ++pieces;
        at += seg.second;
      }
    } else if (r.frozen > 0 && held - r.base < r.frozen) {
      p = Plan{held, 0, true};
      pieces += held > r.base ? 1 : 0;
    } else {
      p = Plan{r.base, r.own_rows, r.frozen > 0};
    }
    if (pieces > kMaxShared) p = Plan{0, 0, r.frozen > 0};
    return p;
  }
  // A new own block after `held` tokens: the session's shared blocks cut to `held` (trimmed), or
  // its own rows up to `held` kept as a shared block (frozen).
  void NewOwnAfter(Ref& r, int64_t held, int64_t capacity) {
    const int block = NewBlock(r, capacity - held);
    if (held < r.base) {
      SetSegs(r, SegsUpTo(r, held));
    } else if (held > r.base) {
      ++blocks_[static_cast<size_t>(r.own)].holders;
      r.segs.emplace_back(r.own, held - r.base);
    }
    ReleaseOwn(r);
    r.own = block;
    r.own_rows = capacity - held;
    r.base = held;
  }
  // What one computed step does to the session's storage (TorchKv::Append).
  void Append(Ref& r, int64_t held, int64_t capacity, int64_t t) {
    const Plan p = PlanOf(r, held);
    if (p.shared == 0 && p.own == 0 && r.base > 0) {  // Compacted: one new block, all copied in.
      const int block = NewBlock(r, capacity);
      SetSegs(r, {});
      ReleaseOwn(r);
      r.own = block;
      r.own_rows = capacity;
      r.base = 0;
    } else if (p.own == 0 && p.shared == held && (held != r.base || r.own < 0 || r.frozen > 0)) {
      NewOwnAfter(r, held, capacity);  // Trimmed or frozen.
    } else if (r.own_rows < held - r.base + t) {
      if (r.frozen > 0) {  // Grown past rows forks read: those become shared, a new block after.
        NewOwnAfter(r, held, capacity);
      } else {  // Grown: copied into a larger block, the old one freed.
        const int block = NewBlock(r, capacity - r.base);
        ReleaseOwn(r);
        r.own = block;
        r.own_rows = capacity - r.base;
      }
    }
  }

  int64_t Indexed(KvKind kind) const {
    int64_t n = 0;
    for (const Ref& r : refs_) n += r.indexed && r.kind == kind;
    return n;
  }
  void Touch(Ref& r) {
    r.touched = ++touches_;
    r.last_use = now_;
  }
  void Count(StatusCode code) {
    switch (code) {
      case StatusCode::kInvalidArgument:
        ++stats_.invalid;
        break;
      case StatusCode::kNotFound:
        ++stats_.not_found;
        break;
      case StatusCode::kResourceExhausted:
        ++stats_.exhausted;
        break;
      case StatusCode::kAborted:
        ++stats_.aborted;
        break;
      default:
        break;
    }
  }
  void Remove(Ref& r, KvEndReason why, const std::string& gone) {
    ++(why == KvEndReason::kEvicted    ? stats_.evicted
       : why == KvEndReason::kExpired  ? stats_.expired
       : why == KvEndReason::kReleased ? stats_.released
                                       : stats_.unloaded);
    r.indexed = false;
    r.gone = gone;
    ++want_ends_[{r.kind, why}];
    removed_now_.push_back(&r - refs_.data());
  }
  void Unhold(size_t ref) { --refs_[ref].holders; }
  std::optional<int64_t> BytesFor(const Ref& r, int64_t capacity) const {
    std::shared_ptr<KvCache> c = r.cache.lock();
    return (c ? c : models_[r.model]->NewKvCache())->BytesFor(r.batch, capacity);
  }

  // The store's MakeRoom, plainly: can `need` more bytes fit once every entry not in use (but
  // `keep`) is evicted, counting each at most its own bytes and, once per family, the blocks its
  // family keeps (those counting themselves)? If so, evict least recently used first until they
  // fit; evicting one whose block forks still read frees nothing (the block counts itself), so it
  // may still not fit. Not `apply`: what would happen, the reference left as it was.
  enum class Fit { kFits, kRefused, kEvictedThenRefused };
  Fit Room(int64_t need, const Ref* keep, bool apply) {
    if (!apply) {
      const auto saved = std::make_tuple(refs_, blocks_, removed_now_, want_ends_, stats_);
      const Fit fit =
          Room(need, keep ? &refs_[static_cast<size_t>(keep - refs_.data())] : nullptr, true);
      std::tie(refs_, blocks_, removed_now_, want_ends_, stats_) = saved;
      return fit;
    }
    std::vector<size_t> candidates;
    std::set<size_t> families;
    int64_t freeable = 0;
    for (size_t i = 0; i < refs_.size(); ++i) {
      Ref& r = refs_[i];
      if (r.indexed && !r.in_use() && &r != keep) {
        candidates.push_back(i);
        families.insert(r.family);
        freeable += r.bytes;
      }
    }
    for (const Block& b : blocks_) {
      if (b.self && b.holders > 0 && families.count(b.family)) freeable += b.bytes;
    }
    if (Account() + need - freeable > options_.budget_bytes) return Fit::kRefused;
    std::sort(candidates.begin(), candidates.end(),
              [&](size_t a, size_t b) { return refs_[a].touched < refs_[b].touched; });
    for (size_t i : candidates) {
      if (Account() + need <= options_.budget_bytes) break;
      Remove(refs_[i], KvEndReason::kEvicted, "evicted (least recently used");
    }
    return Account() + need <= options_.budget_bytes ? Fit::kFits : Fit::kEvictedThenRefused;
  }

  // A handle to name: one the reference knows (any kind, any state), or one nobody made.
  // Mostly a live entry of the kind asked for; sometimes any the reference knows (ended, other
  // kind); rarely one nobody made.
  size_t PickRef(KvKind prefer, std::string* handle) {
    std::vector<size_t> live;
    for (size_t i = 0; i < refs_.size(); ++i) {
      if (refs_[i].kind == prefer && refs_[i].indexed) live.push_back(i);
    }
    const uint64_t how = c_.Below(16);
    if (refs_.empty() || how == 0) {
      // This replica's prefix but never made, another replica's, and no handle at all.
      const std::string& here = store_->replica_id();
      const std::string there = here == "00000000" ? "11111111" : "00000000";
      const std::string strangers[] = {"", here + std::string(24, '0'), "zz", "not a handle at all",
                                       there + std::string(24, 'a')};
      *handle = strangers[c_.Below(5)];
      stranger_ = *handle;
      return SIZE_MAX;
    }
    const size_t i = how < 3 || live.empty() ? c_.Below(refs_.size()) : live[c_.Below(live.size())];
    *handle = refs_[i].handle;
    return i;
  }

  // The store's Lookup, plainly: NOT_FOUND's reason, or "" when found (and renewed).
  std::string Lookup(size_t i, KvKind kind) {
    if (i == SIZE_MAX) {
      return stranger_.size() == 32 && stranger_.compare(0, 8, store_->replica_id()) != 0
                 ? "made by replica " + stranger_.substr(0, 8)
                 : std::string("unknown");
    }
    Ref& r = refs_[i];
    if (!r.indexed) return r.gone;
    if (r.kind != kind)
      return std::string("is a ") + KvKindName(r.kind) + ", not a " + KvKindName(kind);
    if (!r.ready) return "unknown";
    Touch(r);
    return "";
  }

  void ExpectNotFound(const Status& st, const std::string& why, const char* op) {
    ExpectCode(st, StatusCode::kNotFound, op);
    Expect(st.message().find(why) != std::string::npos, [&] {
      return std::string(op) + ": NOT_FOUND '" + st.message() + "' does not say '" + why + "'";
    });
  }

  // ---- operations -------------------------------------------------------------------------------
  // The store's Create, predicted: codes, then evictions.
  StatusCode PredictCreate(const Ref& r, int64_t capacity, int64_t* bytes) {
    if (r.batch < 1 || capacity < 0) return StatusCode::kInvalidArgument;
    const std::optional<int64_t> b = BytesFor(r, capacity);
    if (!b || *b > options_.max_entry_bytes) return StatusCode::kInvalidArgument;
    *bytes = *b;
    if (Indexed(KvKind::kMemory) + Indexed(KvKind::kSession) >= options_.max_entries) {
      return StatusCode::kResourceExhausted;
    }
    const Fit fit = Room(*b, nullptr, false);
    if (fit == Fit::kEvictedThenRefused)
      Room(*b, nullptr, true);  // The store evicted, then refused.
    return fit == Fit::kFits ? StatusCode::kOk : StatusCode::kResourceExhausted;
  }

  std::shared_ptr<KvEntry> Create(Ref r, int64_t capacity, const char* op) {
    int64_t bytes = 0;
    const StatusCode want = PredictCreate(r, capacity, &bytes);
    std::shared_ptr<KvCache> cache = std::move(r.made);
    r.cache = cache;
    auto got = store_->Create(r.kind, models_[r.model], cache, r.batch, capacity, kDefaultTenant);
    ExpectCode(got.status(), want, op);
    if (!got.ok() || want != StatusCode::kOk) return nullptr;
    Room(bytes, nullptr, true);
    r.handle = (*got)->handle;
    r.capacity = capacity;
    r.bytes = bytes;
    Touch(r);
    if (r.family == SIZE_MAX) r.family = refs_.size();
    refs_.push_back(std::move(r));
    return *std::move(got);
  }

  void OpenSession() {
    Ref r;
    r.kind = KvKind::kSession;
    r.model = static_cast<int>(c_.Below(kModels));
    r.made = models_[r.model]->NewKvCache();
    r.batch = c_.Size(3);
    r.ready = true;
    r.real = r.batch >= 1 && r.batch <= 3;
    Note([&] { return std::string("OpenSession batch " + std::to_string(r.batch)); });
    Create(std::move(r), 0, "OpenSession");  // The handler keeps no hold.
  }

  void CreateMemory(bool raw) {
    Ref r;
    r.kind = KvKind::kMemory;
    r.model = static_cast<int>(c_.Below(kModels));
    r.made = models_[r.model]->NewKvCache();
    auto m = std::make_unique<Creating>();
    int64_t length;
    if (raw) {  // The store's own contract, with any sizes.
      r.batch = c_.Size(3);
      length = c_.Size(8);
      Note([&] {
        return std::string("CreateMemory raw batch " + std::to_string(r.batch) + " length " +
                           std::to_string(length));
      });
    } else {  // The service's: validated inputs, then the store.
      r.batch = 1 + static_cast<int64_t>(c_.Below(3));
      length = 1 + static_cast<int64_t>(c_.Below(6));
      r.real = true;
      r.key = Values(++seed_, r.batch * length * kE);
      r.value = Values(++seed_, r.batch * length * kE);
      m->key = Floats({r.batch, length, kE}, r.key);
      m->value = Floats({r.batch, length, kE}, r.value);
      m->call.key = m->key.view();
      m->call.value = m->value.view();
      const Status st = ValidateCreateMemory(models_[r.model]->spec(), AttendLimits{}, &m->call);
      if (!Expect(st.ok(), [&] {
            return std::string("CreateMemory: validation refused [" + std::to_string(r.batch) +
                               ", " + std::to_string(length) + ", 8]: " + st.message());
          })) {
        return;
      }
      Note([&] {
        return std::string("CreateMemory batch " + std::to_string(r.batch) + " length " +
                           std::to_string(length));
      });
    }
    const size_t index = refs_.size();
    m->entry = Create(std::move(r), length, "CreateMemory");
    if (!m->entry) return;
    m->ref = index;
    refs_[index].holders = 1;
    refs_[index].length = 0;
    m->call.kv = refs_[index].cache.lock();
    creating_.push_back(std::move(m));
  }

  void CompleteMemory() {
    if (creating_.empty()) return;
    const size_t i = c_.Below(creating_.size());
    std::unique_ptr<Creating> m = std::move(creating_[i]);
    creating_.erase(creating_.begin() + static_cast<ptrdiff_t>(i));
    Ref& r = refs_[m->ref];
    const bool computed = r.real && !c_.OneIn(8);
    Note([&] {
      return std::string(std::string("CompleteMemory ") + Short(r.handle) +
                         (computed ? " computed" : " failed"));
    });
    if (computed) {
      std::string none;
      AttendOutputs out;
      out.output = &none;
      const Status st = models_[r.model]->ForwardBatch({&m->call}, {&out}, Split())[0];
      if (!Expect(st.ok(),
                  [&] { return std::string("engine: CreateMemory failed: " + st.message()); }))
        return;
      r.allocated = m->call.key_len;
      ++stats_.memories_computed;
      const Status ready = store_->MarkReady(m->entry, m->call.key_len);
      if (r.indexed) {
        ExpectCode(ready, StatusCode::kOk, "MarkReady");
        r.ready = true;
        r.length = m->call.key_len;
        Touch(r);
      } else {
        ExpectCode(ready, StatusCode::kAborted, "MarkReady of an ended memory");
        Expect(ready.message().find(r.gone) != std::string::npos, [&] {
          return std::string("MarkReady: '" + ready.message() + "' does not say '" + r.gone + "'");
        });
      }
    } else {
      store_->Discard(m->entry);
      if (r.indexed) Remove(r, KvEndReason::kFailed, "its keys and values could not be computed");
    }
    m->entry.reset();
    Unhold(m->ref);
  }

  // A handle to step and the session_length to expect (often its own, sometimes not).
  std::optional<int64_t> ExpectedFor(size_t i) {
    const int64_t known = i == SIZE_MAX ? 0 : refs_[i].length;
    switch (c_.Below(8)) {
      case 4:
        return known;
      case 5:
        return known + 1;
      case 6:
        return c_.Size(8);
      case 7:
        return -1 - c_.Size(8) / 2;
      default:
        return std::nullopt;
    }
  }

  void BeginStep() {
    std::string handle;
    const size_t i = PickRef(KvKind::kSession, &handle);
    const std::optional<int64_t> expected = ExpectedFor(i);
    Note([&] {
      return std::string("BeginStep " + Short(handle) + " expecting " +
                         (expected ? std::to_string(*expected) : "-"));
    });
    Begun(i, expected, store_->BeginStep(handle, expected, kDefaultTenant), "BeginStep");
  }

  // A batched step's sessions begun together (KvStore::BeginSteps): 1 to 6 handles, sometimes the
  // same one twice; each result as BeginStep's would be, one after the other under one lock.
  void BeginSteps() {
    const size_t n = 1 + c_.Below(6);
    std::vector<size_t> picked;
    std::vector<std::string> strangers;  // The handle nobody made each entry names (Lookup's).
    std::vector<KvStore::StepBegin> begins;
    for (size_t j = 0; j < n; ++j) {
      std::string handle;
      size_t i = PickRef(KvKind::kSession, &handle);
      if (j > 0 && c_.OneIn(6)) {  // A handle the call names already.
        const size_t again = c_.Below(j);
        i = picked[again];
        handle = begins[again].handle;
        stranger_ = strangers[again];
      }
      picked.push_back(i);
      strangers.push_back(stranger_);
      begins.push_back({handle, ExpectedFor(i)});
    }
    Note([&] { return std::string("BeginSteps of " + std::to_string(n)); });
    auto got = store_->BeginSteps(begins, kDefaultTenant);
    Expect(got.size() == n, [&] { return std::string("BeginSteps: results != entries"); });
    for (size_t j = 0; j < n && j < got.size() && failure_.empty(); ++j) {
      Note([&] {
        return std::string(
            "  entry " + Short(begins[j].handle) + " expecting " +
            (begins[j].expected_length ? std::to_string(*begins[j].expected_length) : "-"));
      });
      stranger_ = strangers[j];
      Begun(picked[j], begins[j].expected_length, std::move(got[j]), "BeginSteps");
    }
  }

  // What BeginStep (or an entry of BeginSteps) on ref `i` gave, against the reference; a step
  // begun joins the flights.
  void Begun(size_t i, std::optional<int64_t> expected, StatusOr<std::unique_ptr<KvStep>> got,
             const char* op) {
    if (expected && *expected < 0)
      return ExpectCode(got.status(), StatusCode::kInvalidArgument, op);
    const std::string missing = Lookup(i, KvKind::kSession);
    if (!missing.empty()) return ExpectNotFound(got.status(), missing, op);
    Ref& r = refs_[i];
    if (r.busy) {
      ExpectCode(got.status(), StatusCode::kAborted, "a step on a busy session");
      return;
    }
    if (expected && *expected != r.length) {
      ExpectCode(got.status(), StatusCode::kAborted, "a step at the wrong length");
      return;
    }
    ExpectCode(got.status(), StatusCode::kOk, op);
    if (!got.ok()) return;
    Expect((*got)->length() == r.length, [&] {
      return std::string(std::string(op) + ": length " + std::to_string((*got)->length()) +
                         ", the reference holds " + std::to_string(r.length));
    });
    r.busy = true;
    ++r.holders;
    auto f = std::make_unique<Flight>();
    f->step = std::move(*got);
    f->ref = i;
    flights_.push_back(std::move(f));
  }

  // The step's query, validated against the session (as the service does), then its reservation.
  void PrepareStep() {
    std::vector<size_t> begun;
    for (size_t k = 0; k < flights_.size(); ++k) {
      if (!flights_[k]->reserved) begun.push_back(k);
    }
    if (begun.empty()) return;
    const size_t k = begun[c_.Below(begun.size())];
    Flight& f = *flights_[k];
    Ref& r = refs_[f.ref];
    const ModelSpec& spec = models_[r.model]->spec();
    int64_t tokens;
    if (c_.OneIn(8)) {  // Straight to the store: any int64 token count.
      tokens = c_.Size(8);
      Note([&] { return std::string("Reserve raw " + std::to_string(tokens)); });
    } else {
      const int64_t b = c_.OneIn(8) ? c_.Size(3) : r.batch, t = c_.Size(6);
      f.seq_first = c_.OneIn(4);
      const bool unbatched = b == 1 && !f.seq_first && c_.OneIn(4);
      std::vector<int64_t> shape = unbatched     ? std::vector<int64_t>{t, kE}
                                   : f.seq_first ? std::vector<int64_t>{t, b, kE}
                                                 : std::vector<int64_t>{b, t, kE};
      const auto numel = CheckedMul({b, t, kE});
      f.real = r.real && b == r.batch && numel && *numel > 0 && *numel <= 4096 &&
               r.length + t <= kMaxRealTokens;
      if (numel && *numel > 0 && *numel <= 4096) {
        f.new_tokens = Values(++seed_, static_cast<size_t>(*numel));
        f.query = Floats(shape, f.seq_first ? f.new_tokens : BatchFirst(f.new_tokens, t, b));
      } else {
        f.query = Buffer{DType::kFloat32, shape, {}};  // Claims the shape, carries no data.
      }
      f.call.query = f.query.view();
      f.call.layout = f.seq_first ? TensorLayout::kSequenceFirst : TensorLayout::kBatchFirst;
      f.call.is_causal = true;  // As FromWire sets it for every session step.
      f.call.kv_use = AttendCall::Kv::kSession;
      f.call.kv = r.cache.lock();
      f.call.kv_batch = r.batch;
      f.call.kv_length = f.step->length();
      Note([&] {
        return std::string("Step query " + ShapeString(shape) + (f.seq_first ? " seq-first" : ""));
      });
      const Status valid = Validate(spec, AttendLimits{}, &f.call);
      if (f.real)
        Expect(valid.ok(),
               [&] { return std::string("Validate refused a good step: " + valid.message()); });
      if (!valid.ok()) return EndFlight(k, false, "refused by validation");
      tokens = f.call.query_len;
    }
    // The store's Reserve, plainly: the session counts the tokens of its own block (those it
    // shares are counted once, by their block), grown by doubling.
    StatusCode want = StatusCode::kOk;
    int64_t capacity = r.capacity, bytes = r.bytes;
    const std::optional<int64_t> needed = tokens < 0 ? std::nullopt : CheckedAdd(r.length, tokens);
    const Plan plan = PlanOf(r, r.length);
    if (!needed) {
      want = StatusCode::kInvalidArgument;
    } else if (*needed - plan.shared > plan.own) {
      const int64_t own_needed = *needed - plan.shared;
      const int64_t doubled = CheckedMul({plan.own, 2}).value_or(own_needed);
      want = StatusCode::kInvalidArgument;
      for (const int64_t c : {std::max<int64_t>({own_needed, doubled, 16}), own_needed}) {
        const std::optional<int64_t> b = BytesFor(r, c);
        if (!b || *b > options_.max_entry_bytes) {
          want = StatusCode::kInvalidArgument;
          continue;
        }
        const int64_t charge = plan.retained ? r.bytes + *b : *b;
        const Fit fit = Room(charge - r.bytes, &r, false);
        if (fit != Fit::kFits) {
          if (fit == Fit::kEvictedThenRefused) Room(charge - r.bytes, &r, true);
          want = StatusCode::kResourceExhausted;
          continue;
        }
        want = StatusCode::kOk;
        capacity = plan.shared + c;
        bytes = charge;
        break;
      }
    }
    const Status got = f.step->Reserve(tokens);
    ExpectCode(got, want, "Reserve");
    if (!got.ok() || want != StatusCode::kOk) return EndFlight(k, false, "not reserved");
    if (capacity != r.capacity || bytes != r.bytes) {
      Room(bytes - r.bytes, &r, true);
      r.capacity = capacity;
      r.bytes = bytes;
    }
    Expect(f.step->capacity() == capacity, [&] {
      return std::string("Reserve: capacity " + std::to_string(f.step->capacity()) +
                         ", the reference says " + std::to_string(capacity));
    });
    f.reserved = true;
    f.tokens = tokens;
    f.call.kv_capacity = f.step->capacity();
  }

  // Ends flight k; applied only after its compute.
  void EndFlight(size_t k, bool applied, const char* why) {
    std::unique_ptr<Flight> f = std::move(flights_[k]);
    flights_.erase(flights_.begin() + static_cast<ptrdiff_t>(k));
    Ref& r = refs_[f->ref];
    const int64_t step_capacity = f->step->capacity();
    Note([&] {
      return std::string(std::string("  step ends ") + (applied ? "applied" : "not applied") +
                         ": " + why);
    });
    if (c_.OneIn(8) && !applied) {
      f->step.reset();  // Dropped without End: its destructor ends it.
    } else {
      f->step->End(applied);
      f->step->End(!applied);  // A second End does nothing.
    }
    r.busy = false;
    ++(applied ? stats_.steps_applied : stats_.steps_not_applied);
    if (applied) {
      r.length += f->tokens;
      r.tokens.insert(r.tokens.end(), f->new_tokens.begin(), f->new_tokens.end());
    }
    const int64_t held = std::max(r.allocated, applied ? step_capacity : 0);
    r.capacity = held;
    r.bytes = BytesFor(r, held - r.base).value_or(-1);
    if (r.indexed) Touch(r);
    f->step.reset();
    Unhold(f->ref);
  }

  // Computes reserved steps of one model in one ForwardBatch, as a batch would; each then ends
  // applied, or not (as one that failed after its compute: a deadline passed, a cancel).
  void ComputeSteps() {
    std::vector<Flight*> ready;
    for (auto& f : flights_) {
      if (f->reserved && f->real) ready.push_back(f.get());
    }
    if (ready.empty()) return;
    const int model = refs_[ready[c_.Below(ready.size())]->ref].model;
    std::vector<Flight*> batch;
    std::vector<const AttendCall*> calls;
    for (auto& f : flights_) {
      if (f->reserved && f->real && refs_[f->ref].model == model &&
          (batch.empty() || !c_.OneIn(4))) {
        batch.push_back(f.get());
        calls.push_back(&f->call);
      }
    }
    if (batch.empty()) return;
    Note([&] { return std::string("ComputeSteps x" + std::to_string(batch.size())); });
    std::vector<std::string> out_bytes(batch.size());
    std::vector<AttendOutputs> outs(batch.size());
    std::vector<AttendOutputs*> out_ptrs;
    for (size_t i = 0; i < batch.size(); ++i) {
      outs[i].output = &out_bytes[i];
      out_ptrs.push_back(&outs[i]);
    }
    const std::vector<Status> statuses = models_[model]->ForwardBatch(calls, out_ptrs, Split());
    for (size_t i = 0; i < batch.size(); ++i) {
      Flight* f = batch[i];
      Ref& r = refs_[f->ref];
      if (!Expect(statuses[i].ok(), [&] {
            return std::string("engine: a session step failed: " + statuses[i].message());
          }))
        return;
      Append(r, f->step->length(), f->step->capacity(), f->tokens);
      r.allocated = r.base + r.own_rows;
      const bool applied = !c_.OneIn(4);
      const size_t k = std::find_if(flights_.begin(), flights_.end(),
                                    [&](const auto& p) { return p.get() == f; }) -
                       flights_.begin();
      const bool seq_first = f->seq_first;
      const int64_t t = f->tokens, b = r.batch;
      EndFlight(k, applied, applied ? "computed" : "computed, then failed");
      if (applied && o_.check_outputs) {
        if (o_.stats && std::string(outs[i].attention_backend) == "kept_emulated")
          ++o_.stats->kept_answers_checked;
        CheckStepAnswer(r, out_bytes[i], t, b, seq_first);
      }
    }
  }

  void DropStep() {
    if (flights_.empty()) return;
    EndFlight(c_.Below(flights_.size()), false, "failed before compute");
  }

  // The step's answer (its last t rows) against one causal self-attention over every applied token.
  void CheckStepAnswer(const Ref& r, const std::string& got, int64_t t, int64_t b, bool seq_first) {
    const int64_t l = r.length;
    Buffer x = Floats({l, b, kE}, r.tokens);
    AttendCall whole;
    whole.query = x.view();
    whole.layout = TensorLayout::kSequenceFirst;
    whole.is_causal = true;
    const ModelSpec& spec = models_[r.model]->spec();
    if (!Expect(Validate(spec, AttendLimits{}, &whole).ok(),
                [&] { return std::string("the one causal call does not validate"); }))
      return;
    std::string want_bytes;
    AttendOutputs out;
    out.output = &want_bytes;
    if (!Expect(models_[r.model]->Forward(whole, &out).ok(),
                [&] { return std::string("engine: the one causal call failed"); }))
      return;
    const float* w = reinterpret_cast<const float*>(want_bytes.data());
    std::vector<float> want(w + (l - t) * b * kE, w + l * b * kE);  // Its last t rows, [t, b, E].
    if (!seq_first) want = BatchFirst(want, t, b);
    ++stats_.step_answers_checked;
    if (spec.decoder) ++stats_.decoder_answers_checked;
    const double err = RelativeError(got, want);
    Expect(err <= 1e-5, [&] {
      return std::string(
          "a step's answer differs from one causal call over the applied tokens by " +
          std::to_string(err) + " of its scale (allowed 1e-5)");
    });
  }

  void QueryMemory() {
    std::string handle;
    const size_t i = PickRef(KvKind::kMemory, &handle);
    const bool hold = c_.OneIn(4);
    Note([&] { return std::string("QueryMemory " + Short(handle) + (hold ? " (held)" : "")); });
    auto got = store_->Lookup(handle, KvKind::kMemory, kDefaultTenant);
    const std::string missing = Lookup(i, KvKind::kMemory);
    if (!missing.empty()) return ExpectNotFound(got.status(), missing, "Lookup");
    ExpectCode(got.status(), StatusCode::kOk, "Lookup");
    if (!got.ok()) return;
    Ref& r = refs_[i];
    if (hold) {
      ++r.holders;
      holds_.push_back(Hold{*std::move(got), i});
      return;
    }
    if (!r.real) return;
    const int64_t lq = 1 + static_cast<int64_t>(c_.Below(4));
    Buffer q = Floats({r.batch, lq, kE}, Values(++seed_, r.batch * lq * kE));
    AttendCall call;
    call.query = q.view();
    call.kv_use = AttendCall::Kv::kMemory;
    call.kv = r.cache.lock();
    call.kv_batch = r.batch;
    call.kv_length = (*got)->length;
    const ModelSpec& spec = models_[r.model]->spec();
    if (!Expect(Validate(spec, AttendLimits{}, &call).ok(),
                [&] { return std::string("a memory query does not validate"); }))
      return;
    std::string a;
    AttendOutputs oa;
    oa.output = &a;
    if (!Expect(models_[r.model]->Forward(call, &oa).ok(),
                [&] { return std::string("engine: a memory query failed"); }))
      return;
    if (!o_.check_outputs) return;
    const int64_t lk = r.length;
    Buffer k = Floats({r.batch, lk, kE}, r.key), v = Floats({r.batch, lk, kE}, r.value);
    AttendCall wire;
    wire.query = q.view();
    wire.key = k.view();
    wire.value = v.view();
    if (!Expect(Validate(spec, AttendLimits{}, &wire).ok(),
                [&] { return std::string("the wire cross-attention does not validate"); }))
      return;
    std::string b;
    AttendOutputs ob;
    ob.output = &b;
    if (!Expect(models_[r.model]->Forward(wire, &ob).ok(),
                [&] { return std::string("engine: the wire cross-attention failed"); }))
      return;
    const float* wb = reinterpret_cast<const float*>(b.data());
    ++stats_.memory_answers_checked;
    if (spec.decoder) ++stats_.decoder_answers_checked;
    const double err = RelativeError(a, std::vector<float>(wb, wb + b.size() / sizeof(float)));
    Expect(err <= 1e-5, [&] {
      return std::string("a memory's answer differs from key and value on the wire by " +
                         std::to_string(err));
    });
  }

  void DropHold() {
    if (holds_.empty()) return;
    const size_t i = c_.Below(holds_.size());
    Note([&] { return std::string("DropHold " + Short(refs_[holds_[i].ref].handle)); });
    const size_t ref = holds_[i].ref;
    holds_.erase(holds_.begin() + static_cast<ptrdiff_t>(i));
    Unhold(ref);
  }

  void Release() {
    const KvKind kind = c_.Below(2) ? KvKind::kSession : KvKind::kMemory;
    std::string handle;
    const size_t i = PickRef(kind, &handle);
    Note([&] {
      return std::string(std::string("Release ") + KvKindName(kind) + " " + Short(handle));
    });
    auto got = store_->Release(handle, kind, kDefaultTenant);
    const std::string missing = Lookup(i, kind);
    if (!missing.empty()) return ExpectNotFound(got.status(), missing, "Release");
    ExpectCode(got.status(), StatusCode::kOk, "Release");
    Ref& r = refs_[i];
    if (got.ok())
      Expect(*got == r.bytes, [&] {
        return std::string("Release: " + std::to_string(*got) +
                           " bytes freed, the reference holds " + std::to_string(r.bytes));
      });
    Remove(r, KvEndReason::kReleased,
           kind == KvKind::kMemory ? "deleted (DeleteMemory)" : "closed (CloseSession)");
  }

  // ForkSession: a copy of a session as it is (tokens, length, capacity), held like a step while
  // it is made, so a session with a step in flight is ABORTED and the parent is never evicted to
  // make room for its copy.
  void Fork() {
    std::string handle;
    const size_t i = PickRef(KvKind::kSession, &handle);
    Note([&] { return std::string("Fork " + Short(handle)); });
    std::shared_ptr<KvCache> cache = models_[i == SIZE_MAX ? 0 : refs_[i].model]->NewKvCache();
    auto got = store_->Fork(handle, cache, kDefaultTenant);
    const std::string missing = Lookup(i, KvKind::kSession);
    if (!missing.empty()) return ExpectNotFound(got.status(), missing, "Fork");
    if (refs_[i].busy)
      return ExpectCode(got.status(), StatusCode::kAborted, "Fork of a busy session");
    Ref r;
    {
      const Ref& p = refs_[i];
      r.kind = KvKind::kSession;
      r.model = p.model;
      r.cache = cache;
      r.batch = p.batch;
      r.ready = true;
      r.real = p.real;
      r.tokens = p.tokens;
      r.length = p.length;
      r.family = p.family;
    }
    int64_t bytes = 0;
    refs_[i].busy = true;  // As the store holds it while the fork is made.
    const StatusCode want = PredictCreate(r, 0, &bytes);
    ExpectCode(got.status(), want, "Fork");
    if (got.ok() && want == StatusCode::kOk) {
      // It shares the parent's first `length` tokens: nothing copied, nothing counted for it.
      Ref& p = refs_[i];
      r.segs = SegsUpTo(p, std::min(p.length, p.base));
      if (p.length > p.base) {
        ++blocks_[static_cast<size_t>(p.own)].holders;
        r.segs.emplace_back(p.own, p.length - p.base);
        p.frozen = std::max(p.frozen, p.length - p.base);
      }
      r.base = p.length;
      r.allocated = r.capacity = p.length;
      r.handle = (*got)->handle;
      r.bytes = 0;
      Touch(r);
      refs_[i].busy = false;
      Touch(refs_[i]);  // The store lets go of the parent after making the fork: it is the newer.
      refs_.push_back(std::move(r));
      ++stats_.forks;
    } else {
      refs_[i].busy = false;
    }
  }

  // TruncateSession: any length the session holds (most often), just past it, or any int64.
  void Truncate() {
    std::string handle;
    const size_t i = PickRef(KvKind::kSession, &handle);
    const int64_t known = i == SIZE_MAX ? 0 : refs_[i].length;
    int64_t length;
    switch (c_.Below(4)) {
      case 0:
        length = known + 1 + static_cast<int64_t>(c_.Below(64));  // Lengths held stay small.
        break;
      case 1:
        length = c_.Size(8);  // Anything, the int64 extremes included.
        break;
      default:
        length = static_cast<int64_t>(c_.Below(static_cast<uint64_t>(known) + 1));
    }
    Note(
        [&] { return std::string("Truncate " + Short(handle) + " to " + std::to_string(length)); });
    const Status got = store_->Truncate(handle, length, kDefaultTenant);
    const std::string missing = Lookup(i, KvKind::kSession);
    if (!missing.empty()) return ExpectNotFound(got, missing, "Truncate");
    Ref& r = refs_[i];
    if (r.busy) return ExpectCode(got, StatusCode::kAborted, "Truncate on a busy session");
    if (length < 0 || length > r.length) {
      return ExpectCode(got, StatusCode::kInvalidArgument, "Truncate out of range");
    }
    ExpectCode(got, StatusCode::kOk, "Truncate");
    ++stats_.truncations;
    r.length = length;
    const size_t keep = static_cast<size_t>(length * r.batch * kE);
    if (r.tokens.size() > keep) r.tokens.resize(keep);
  }

  void Tick() {
    const int64_t ttl = static_cast<int64_t>(options_.ttl_seconds);
    const uint64_t how = c_.Below(16);
    const int64_t dt = how == 0  ? int64_t{1} << (10 + c_.Below(20))
                       : how < 4 ? static_cast<int64_t>(c_.Below(2 * ttl + 2))
                                 : static_cast<int64_t>(c_.Below(ttl / 4 + 1));
    now_ += std::chrono::seconds(dt);
    Note([&] { return std::string("Tick " + std::to_string(dt) + " s"); });
    store_->ExpireIdle(now_);
    for (Ref& r : refs_) {
      if (r.indexed && !r.in_use() && now_ - r.last_use >= std::chrono::seconds(ttl)) {
        Remove(r, KvEndReason::kExpired, "expired (unused for " + std::to_string(ttl) + " s");
      }
    }
  }

  void Unload() {
    const int model = static_cast<int>(c_.Below(kModels));
    Note([&] { return std::string(std::string("Unload model ") + (model ? "b" : "a")); });
    store_->EndModel(models_[model]->spec());
    for (Ref& r : refs_) {
      if (r.indexed && r.model == model) Remove(r, KvEndReason::kUnloaded, "unloaded by a reload");
    }
  }

  void EndAll() {
    Note([&] { return std::string("Clear"); });
    store_->Clear("the test stops");
    for (Ref& r : refs_) {
      if (r.indexed) Remove(r, KvEndReason::kShutdown, "ended: the test stops");
    }
  }

  // ---- invariants -------------------------------------------------------------------------------
  void CheckInvariants() {
    std::vector<KvEntryInfo> snapshot = store_->Snapshot();
    std::sort(snapshot.begin(), snapshot.end(),
              [](const KvEntryInfo& x, const KvEntryInfo& y) { return x.handle < y.handle; });
    size_t indexed = 0;
    for (const Ref& r : refs_) {
      if (!r.indexed) continue;
      ++indexed;
      const auto it =
          std::lower_bound(snapshot.begin(), snapshot.end(), r.handle,
                           [](const KvEntryInfo& x, const std::string& h) { return x.handle < h; });
      const auto name = [&] { return std::string(KvKindName(r.kind)) + " " + Short(r.handle); };
      if (!Expect(it != snapshot.end() && it->handle == r.handle,
                  [&] { return name() + " is gone from the store; the reference holds it"; })) {
        return;
      }
      const KvEntryInfo& e = *it;
      const auto fields = [](int64_t length, int64_t capacity, int64_t bytes, bool busy,
                             bool ready) {
        return "length " + std::to_string(length) + ", capacity " + std::to_string(capacity) +
               ", bytes " + std::to_string(bytes) + (busy ? ", busy" : "") +
               (ready ? "" : ", not ready");
      };
      if (!Expect(e.kind == r.kind && e.batch == r.batch && e.length == r.length &&
                      e.capacity == r.capacity && e.bytes == r.bytes && e.busy == r.busy &&
                      e.ready == r.ready,
                  [&] {
                    return name() + ": the store holds " +
                           fields(e.length, e.capacity, e.bytes, e.busy, e.ready) +
                           "; the reference " +
                           fields(r.length, r.capacity, r.bytes, r.busy, r.ready);
                  })) {
        return;
      }
      // Its own tokens (those it shares are counted by their block); a step in flight may hold a
      // replaced block beside the new one.
      const std::optional<int64_t> bytes = BytesFor(r, r.capacity - r.base);
      Expect((e.busy || (bytes && *bytes == e.bytes)) && e.bytes <= 2 * options_.max_entry_bytes &&
                 e.bytes >= 0,
             [&] {
               return name() + ": " + std::to_string(e.bytes) +
                      " bytes for its capacity, over the entry limit or not its size (capacity " +
                      std::to_string(r.capacity) + ", shared " + std::to_string(r.base) + ", own " +
                      std::to_string(r.own_rows) + ", length " + std::to_string(r.length) +
                      (e.busy ? ", busy" : "") + ", allocated " + std::to_string(r.allocated) + ")";
             });
      Expect(r.kind == KvKind::kMemory || e.capacity >= e.length,
             [&] { return name() + ": capacity below its length"; });
      if (!e.busy && e.ready) {
        const std::shared_ptr<KvCache> cache = r.cache.lock();
        Expect(cache && cache->AllocatedTokens() == e.capacity, [&] {
          return name() + ": the engine holds " +
                 (cache ? std::to_string(cache->AllocatedTokens()) : std::string("nothing")) +
                 " tokens, the store counts " + std::to_string(e.capacity);
        });
      }
    }
    Expect(indexed == snapshot.size(), [&] {
      return "the store holds " + std::to_string(snapshot.size()) + " entries, the reference " +
             std::to_string(indexed);
    });
    const int64_t account = Account();
    Expect(store_->bytes() == account && gauge_bytes_ == account, [&] {
      return "bytes held: store " + std::to_string(store_->bytes()) + ", gauge " +
             std::to_string(gauge_bytes_) +
             ", the reference (live entries and ended ones still held) " + std::to_string(account);
    });
    Expect(
        gauge_memories_ == Indexed(KvKind::kMemory) && gauge_sessions_ == Indexed(KvKind::kSession),
        [&] {
          return "entry gauges " + std::to_string(gauge_memories_) + "/" +
                 std::to_string(gauge_sessions_) + ", the reference " +
                 std::to_string(Indexed(KvKind::kMemory)) + "/" +
                 std::to_string(Indexed(KvKind::kSession));
        });
    Expect(!negative_, [] { return std::string("a gauge went negative"); });
    Expect(account <= options_.budget_bytes, [&] {
      return "bytes held " + std::to_string(account) + " are over the budget " +
             std::to_string(options_.budget_bytes);
    });
    Expect(ends_ == want_ends_,
           [] { return std::string("attnserve_kv_ends_total differs from the reference's ends"); });
    for (size_t i : removed_now_) {  // What just ended says why.
      const Ref& r = refs_[i];
      ExpectNotFound(store_->Lookup(r.handle, r.kind, kDefaultTenant).status(), r.gone,
                     "a removed entry's lookup");
    }
  }

  Choices& c_;
  const KvCheckOptions o_;
  const std::shared_ptr<const AttentionModel>* models_;
  KvOptions options_;
  KvClock::time_point now_ = KvClock::time_point{} + std::chrono::hours(1);
  std::unique_ptr<KvStore> store_;
  std::string stranger_;  // The handle nobody made that PickRef named last.
  std::vector<Ref> refs_;
  std::vector<Block> blocks_;  // Every block a session allocated, by index.
  std::vector<std::unique_ptr<Flight>> flights_;
  std::vector<std::unique_ptr<Creating>> creating_;
  std::vector<Hold> holds_;
  std::vector<size_t> removed_now_;
  uint64_t touches_ = 0, seed_ = 0;
  int64_t gauge_bytes_ = 0, gauge_memories_ = 0, gauge_sessions_ = 0;
  bool negative_ = false;
  std::map<std::pair<KvKind, KvEndReason>, int64_t> ends_, want_ends_;
  std::string failure_;
  KvCheckStats stats_;
};

}  // namespace

std::string RunKvModelCheck(Choices& choices, const KvCheckOptions& options) {
  ModelCheck check(choices, options);
  return check.Run();
}

}  // namespace attnserve::testing
