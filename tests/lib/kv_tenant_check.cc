#include "tests/lib/kv_tenant_check.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/kv/kv_store.h"
#include "server/tenants/tenants.h"
#include "tests/lib/kv_model_check.h"
#include "tests/lib/mha_reference.h"

namespace attnserve::testing {
namespace {

constexpr int64_t kE = 8;
// What one token of one sequence takes: keys and values of 8 floats each, and the key padding.
constexpr int64_t kTokenBytes = 68;
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kExtremes[] = {0,
                                 -1,
                                 std::numeric_limits<int64_t>::min(),
                                 kMax,
                                 kMax - 1,
                                 int64_t{1} << 62,
                                 int64_t{1} << 31,
                                 -(int64_t{1} << 62)};

// One small model on the CPU, made once for the process.
const std::shared_ptr<const AttentionModel>& Model() {
  static const std::shared_ptr<const AttentionModel> model = [] {
    std::mt19937 rng(31);
    ModelWeights w = RandomWeights(rng, "p", kE, 2);
    w.spec.weights_hash = "sha256:p";
    auto m = CreateTorchModel(w, EngineOptions{});
    if (!m.ok()) {
      std::fprintf(stderr, "kv tenant check: %s\n", m.status().message().c_str());
      std::abort();
    }
    return std::shared_ptr<const AttentionModel>(std::move(m).value());
  }();
  return model;
}

// `message` with every `from` replaced by `to`: two answers compared as if about one handle.
std::string Renamed(std::string message, const std::string& from, const std::string& to) {
  for (size_t at = message.find(from); !from.empty() && at != std::string::npos;
       at = message.find(from, at + to.size())) {
    message.replace(at, from.size(), to);
  }
  return message;
}

// The number before `words` in `message` ("... 4096 more needed"), or -1.
int64_t NumberBefore(const std::string& message, const std::string& words) {
  const size_t at = message.find(" " + words);
  if (at == std::string::npos) return -1;
  size_t from = at;
  while (from > 0 && std::isdigit(static_cast<unsigned char>(message[from - 1]))) --from;
  return from == at ? -1 : std::stoll(message.substr(from, at - from));
}

std::string CodeName(StatusCode code) { return std::to_string(static_cast<int>(code)); }

}  // namespace

struct KvTenantMachine::State {
  struct Made {
    std::string handle, tenant;
    KvKind kind = KvKind::kSession;
    int64_t batch = 1, length = 0;
    bool open = true;
  };

  KvTenantOptions options;
  std::shared_ptr<const Tenants> terms;
  KvOptions kv;
  // What the store reports (attnserve_tenant_kv_bytes by label, attnserve_kv_bytes).
  std::map<std::string, int64_t> labels;
  int64_t gauge = 0;
  KvClock::time_point now{std::chrono::hours(1)};
  std::unique_ptr<KvStore> store;  // After what its hooks write, before what it hands out.
  std::string never;               // A handle of this replica never made.
  std::vector<Made> made;
  std::map<std::string, std::string> owner;     // Tenant by handle.
  std::vector<std::shared_ptr<KvEntry>> holds;  // Requests using entries.
  std::mt19937 values{1};                       // Token values (no choice: any will do).
  std::map<std::string, int64_t> seen;
  int op = 0;
  std::string broken;  // Set when the terms could not be read.

  explicit State(const KvTenantOptions& o) : options(o) {
    auto parsed = Tenants::Parse(o.tenants_json, "tenants.json");
    if (parsed.ok()) {
      terms = *parsed;
    } else {
      broken = "the tenants file: " + parsed.status().message();
      terms = std::make_shared<Tenants>();
    }
    kv.budget_bytes = o.budget_bytes;
    kv.max_entry_bytes = o.max_entry_bytes;
    kv.max_entries = o.max_entries;
    kv.ttl_seconds = o.ttl_seconds;
    KvMetricsHooks hooks;
    hooks.on_size = [this](int64_t bytes, int64_t, int64_t) { gauge = bytes; };
    hooks.on_tenant_bytes = [this](const std::string& label, int64_t bytes) {
      labels[label] = bytes;
    };
    store = std::make_unique<KvStore>(kv, std::move(hooks), [this] { return now; });
    store->SetTenants(terms);
    never = store->replica_id() + std::string(24, '7');
  }

  // "" when every byte the store holds is charged to exactly one tenant (their bytes, and the
  // labels', add up to the store's and its gauge's), none over its cap, the store within its
  // budget; else what broke.
  std::string Books() const {
    std::string out;
    int64_t sum = 0, labelled = 0;
    for (const std::string& t : options.tenants) {
      const int64_t mine = store->TenantBytes(t), cap = terms->Of(t).kv_max_bytes;
      sum += mine;
      if (mine < 0 || (cap > 0 && mine > cap)) {
        out += "tenant '" + t + "' holds " + std::to_string(mine) + " bytes, cap " +
               std::to_string(cap) + "; ";
      }
    }
    for (const auto& [label, bytes] : labels) labelled += bytes;
    const int64_t held = store->bytes();
    if (sum != held || labelled != held || gauge != held || held > kv.budget_bytes) {
      out += "the store holds " + std::to_string(held) + " bytes (gauge " + std::to_string(gauge) +
             ", budget " + std::to_string(kv.budget_bytes) + "), the tenants " +
             std::to_string(sum) + ", their labels " + std::to_string(labelled);
    }
    return out;
  }

  Made* Pick(Choices& c, const std::string& t, KvKind kind) {
    std::vector<Made*> mine;
    for (Made& m : made) {
      if (m.open && m.tenant == t && m.kind == kind) mine.push_back(&m);
    }
    return mine.empty() ? nullptr : mine[c.Below(mine.size())];
  }

  static int64_t Extreme(Choices& c) { return kExtremes[c.Below(std::size(kExtremes))]; }

  int64_t Size(Choices& c, int64_t small) {
    return c.OneIn(8) ? Extreme(c)
                      : static_cast<int64_t>(c.Below(static_cast<uint64_t>(small + 1)));
  }

  // A new entry's sizes are refused unless they are those of one entry.
  bool Fits(int64_t batch, int64_t capacity) const {
    const std::optional<int64_t> bytes = Model()->NewKvCache()->BytesFor(batch, capacity);
    return batch >= 1 && capacity >= 0 && bytes && *bytes <= kv.max_entry_bytes;
  }

  Status Create(const std::string& t, KvKind kind, int64_t batch, int64_t capacity) {
    auto e = store->Create(kind, Model(), Model()->NewKvCache(), batch, capacity, t);
    if (!e.ok()) return e.status();
    if (kind == KvKind::kMemory) RETURN_IF_ERROR(store->MarkReady(*e, capacity));
    made.push_back({(*e)->handle, t, kind, batch, kind == KvKind::kMemory ? capacity : 0});
    owner[(*e)->handle] = t;
    return Status::Ok();
  }

  // An admitted step of `tokens` new tokens on session `s`: its query validated against the
  // session's length and room reserved (Reserve), then computed and ended (Finish).
  struct Pending {
    std::unique_ptr<KvStep> step;
    Made* session = nullptr;
    int64_t tokens = 0;
    Buffer q;
    AttendCall call;
    Status status;
  };
  void Reserve(Pending* p) {
    const int64_t n = p->tokens * p->session->batch * kE;
    p->q = Floats({p->tokens, p->session->batch, kE}, RandomFloats(values, static_cast<size_t>(n)));
    AttendCall& call = p->call;
    call.query = p->q.view();
    call.layout = TensorLayout::kSequenceFirst;
    call.is_causal = true;
    call.kv_use = AttendCall::Kv::kSession;
    call.kv = p->step->entry()->cache;
    call.kv_batch = p->step->entry()->batch;
    call.kv_length = p->step->length();
    p->status = Validate(Model()->spec(), {}, &call);
    if (p->status.ok()) p->status = p->step->Reserve(call.query_len);
  }
  // Applied when `apply`; the step's status.
  Status Finish(Pending* p, bool apply) {
    if (p->status.ok()) {
      p->call.kv_capacity = p->step->capacity();
      std::string out;
      AttendOutputs o;
      o.output = &out;
      p->status = Model()->Forward(p->call, &o);
    }
    p->step->End(p->status.ok() && apply);
    if (p->status.ok() && apply) p->session->length += p->tokens;
    return p->status;
  }

  // A step the way the service runs one: BeginStep, validation against the session's length,
  // Reserve, compute, End (applied when `apply`).
  Status RunStep(Made& s, int64_t tokens, bool apply, const std::string& t) {
    auto begun = store->BeginStep(s.handle, s.length, t);
    if (!begun.ok()) return begun.status();
    Pending p;
    p.step = std::move(*begun);
    p.session = &s;
    p.tokens = tokens;
    Reserve(&p);
    return Finish(&p, apply);
  }

  std::string Step(Choices& c) {
    if (!broken.empty()) return broken;
    const int at_op = op++;
    now += std::chrono::milliseconds(10);
    const std::string& t = options.tenants[c.Below(options.tenants.size())];
    // What each tenant is charged, and of that what its families keep beyond its entries' own
    // bytes (and entries ended while held).
    std::map<std::string, int64_t> before, kept;
    for (const std::string& n : options.tenants) kept[n] = before[n] = store->TenantBytes(n);
    for (const KvEntryInfo& e : store->Snapshot()) kept[owner[e.handle]] -= e.bytes;
    std::string what, out;
    Status st;
    std::optional<StatusCode> want;  // When the call's answer is known in advance.
    bool ticked = false;
    const uint64_t kind = c.Below(20);
    Made* s = Pick(c, t, KvKind::kSession);
    if (kind < 2 || (kind < 9 && s == nullptr)) {
      const int64_t batch = c.OneIn(8) ? Extreme(c) : 1 + static_cast<int64_t>(c.Below(3));
      const int64_t capacity = c.OneIn(4) ? Size(c, 64) : 0;
      what = "open " + std::to_string(batch) + " x " + std::to_string(capacity);
      if (!Fits(batch, capacity)) want = StatusCode::kInvalidArgument;
      st = Create(t, KvKind::kSession, batch, capacity);
    } else if (kind < 6) {
      const int64_t tokens = c.OneIn(8) ? Extreme(c) : 1 + static_cast<int64_t>(c.Below(12));
      what = "step " + std::to_string(tokens) + " on " + std::to_string(s->length);
      // Sizes no step may have (a session of 0 tokens may be opened for any batch): reserved
      // only, never computed.
      if (tokens <= 0 || tokens > (int64_t{1} << 20) || s->batch > 3) {
        want = tokens == 0 ? StatusCode::kOk : StatusCode::kInvalidArgument;
        auto step = store->BeginStep(s->handle, s->length, t);
        st = step.ok() ? (*step)->Reserve(tokens) : step.status();
      } else {
        st = RunStep(*s, tokens, !c.OneIn(5), t);
        if (st.code() == StatusCode::kInvalidArgument) ++seen["over one entry"];
      }
    } else if (kind < 8) {
      what = "fork at " + std::to_string(s->length);
      auto fork = store->Fork(s->handle, Model()->NewKvCache(), t);
      st = fork.status();
      if (fork.ok()) {
        made.push_back({(*fork)->handle, t, KvKind::kSession, s->batch, s->length});
        owner[(*fork)->handle] = t;
        ++seen["forks"];
      }
    } else if (kind < 9) {
      const int64_t length =
          c.OneIn(6) ? Extreme(c)
                     : static_cast<int64_t>(c.Below(static_cast<uint64_t>(s->length + 2)));
      what = "truncate " + std::to_string(s->length) + " to " + std::to_string(length);
      want = length >= 0 && length <= s->length ? StatusCode::kOk : StatusCode::kInvalidArgument;
      st = store->Truncate(s->handle, length, t);
      if (st.ok()) s->length = length;
    } else if (kind < 10) {
      Made* m = c.Below(2) ? s : Pick(c, t, KvKind::kMemory);
      if (m == nullptr) return Log(t, "release nothing");
      what = std::string("release a ") + KvKindName(m->kind);
      want = StatusCode::kOk;
      st = store->Release(m->handle, m->kind, t).status();
      m->open = false;
    } else if (kind < 12) {
      const int64_t batch = c.OneIn(8) ? Extreme(c) : 1 + static_cast<int64_t>(c.Below(2));
      // Half of them near the largest one entry may be, for its batch: pressure on the budget.
      const int64_t rows = batch >= 1 && batch <= 2 ? batch : 1;
      const int64_t capacity =
          c.OneIn(2) ? kv.max_entry_bytes / (kTokenBytes * rows) - static_cast<int64_t>(c.Below(40))
                     : Size(c, 120);
      what = "memory " + std::to_string(batch) + " x " + std::to_string(capacity);
      if (!Fits(batch, capacity)) want = StatusCode::kInvalidArgument;
      st = Create(t, KvKind::kMemory, batch, capacity);
    } else if (kind < 15) {
      // Another tenant's handle, open or ended, against one never made.
      std::vector<const Made*> theirs;
      for (const Made& m : made) {
        if (m.tenant != t) theirs.push_back(&m);
      }
      if (theirs.empty()) return Log(t, "probe nothing");
      const Made& m = *theirs[c.Below(theirs.size())];
      const uint64_t call = c.Below(6);
      const auto ask = [&](const std::string& h) -> Status {
        switch (call) {
          case 0:
            return store->Lookup(h, m.kind, t).status();
          case 1:
            return store->BeginStep(h, std::nullopt, t).status();
          case 2:
            return store->Fork(h, Model()->NewKvCache(), t).status();
          case 3:
            return store->Truncate(h, 0, t);
          case 4:
            return store->Release(h, m.kind, t).status();
          default:
            return store->Lookup(h, KvKind::kMemory, t).status();
        }
      };
      what = "probe " + std::string(m.open ? "an open " : "an ended ") + KvKindName(m.kind) +
             " of " + m.tenant + " (call " + std::to_string(call) + ")";
      const Status got = ask(m.handle), unknown = ask(never);
      if (got.code() != unknown.code() ||
          Renamed(got.message(), m.handle, never) != unknown.message()) {
        out += "another tenant's handle answers " + CodeName(got.code()) + " '" + got.message() +
               "', one never made " + CodeName(unknown.code()) + " '" + unknown.message() + "'; ";
      }
      ++seen[m.open ? "probes of open handles" : "probes of ended handles"];
    } else if (kind == 15 && holds.size() < 6) {
      // A request using one of its entries: not evicted or expired meanwhile, and charged to its
      // tenant until let go even once it ends.
      Made* m = c.Below(2) ? s : Pick(c, t, KvKind::kMemory);
      if (m == nullptr) return Log(t, "hold nothing");
      what = std::string("hold a ") + KvKindName(m->kind);
      auto e = store->Lookup(m->handle, m->kind, t);
      st = e.status();
      want = StatusCode::kOk;
      if (e.ok()) holds.push_back(*e);
    } else if (kind == 16 && !holds.empty()) {
      // At times every request ends at once: refusals with nothing in use check the most.
      if (c.OneIn(4)) {
        what = "let go of every hold";
        holds.clear();
      } else {
        what = "let go of a hold";
        holds.erase(holds.begin() + static_cast<long>(c.Below(holds.size())));
      }
      ++seen["holds let go"];
    } else if (kind == 17 || kind == 18) {
      what = "batched steps";
      out += BatchedSteps(c, t, &what);
    } else {
      now += std::chrono::seconds(c.Below(8));
      what = "tick";
      ticked = true;
      store->ExpireIdle(now);
    }
    Log(t, what + ": " + (st.ok() ? "OK" : st.message()));
    if (want) {
      if (st.code() != *want) {
        out += "answered " + CodeName(st.code()) + " '" + st.message() + "', expected " +
               CodeName(*want) + "; ";
      }
    } else if (!st.ok() && st.code() != StatusCode::kResourceExhausted &&
               st.code() != StatusCode::kInvalidArgument) {
      out += "answered " + CodeName(st.code()) + " '" + st.message() + "'; ";
    }
    if (st.code() == StatusCode::kInvalidArgument) ++seen["invalid"];
    if (st.code() == StatusCode::kResourceExhausted) {
      const TenantPolicy& p = terms->Of(t);
      if (const int64_t need = NumberBefore(st.message(), "more needed"); need >= 0) {
        ++seen["refused room"];
        // With nothing in use but t's own step, room is refused only when what the others keep
        // could not go: of a tenant with no guarantee nothing, of one with a guarantee less than
        // the guarantee, one entry and the blocks its families keep.
        int64_t guarded = 0;
        for (const std::string& n : options.tenants) {
          const int64_t g = terms->Of(n).kv_guaranteed_bytes;
          if (n != t && g > 0) guarded += std::min(before[n], g + kv.max_entry_bytes + kept[n]);
        }
        if (holds.empty()) ++seen["refused room, nothing held"];
        if (holds.empty() && st.message().find("in use or guaranteed") != std::string::npos) {
          if (before[t] + need + guarded <= kv.budget_bytes) {
            out += "refused what evicting could give: " + st.message() + "; ";
          }
        } else if (holds.empty()) {  // Evicted all it could, then refused.
          for (const std::string& n : options.tenants) {
            if (n != t && terms->Of(n).kv_guaranteed_bytes == 0 && store->TenantBytes(n) != 0) {
              out += n + " kept " + std::to_string(store->TenantBytes(n)) +
                     " bytes: " + st.message() + "; ";
            }
          }
        }
      } else if (const int64_t over = NumberBefore(st.message(), "more, over its kv_max_bytes");
                 over >= 0) {
        ++seen["capped"];
        if (before[t] + over <= p.kv_max_bytes)
          out += "capped below its cap: " + st.message() + "; ";
      } else {
        ++seen["entries full"];
      }
    }
    // What the index no longer holds ended: lost to another tenant's need, it left its tenant at
    // least its guarantee.
    std::set<std::string> indexed;
    int64_t counted = 0;
    for (const KvEntryInfo& e : store->Snapshot()) {
      indexed.insert(e.handle);
      counted += e.bytes;
    }
    if (store->bytes() > counted) ++seen["blocks kept by forks alone"];
    for (Made& m : made) {
      if (!m.open || indexed.count(m.handle)) continue;
      m.open = false;
      if (ticked || m.tenant == t) continue;
      ++seen["evicted for another tenant"];
      const int64_t floor = std::min(before[m.tenant], terms->Of(m.tenant).kv_guaranteed_bytes);
      if (store->TenantBytes(m.tenant) < floor) {
        out += m.tenant +
               " taken below its guarantee: " + std::to_string(store->TenantBytes(m.tenant)) +
               " < " + std::to_string(floor) + "; ";
      }
    }
    out += Books();
    if (out.empty()) return "";
    return "op " + std::to_string(at_op) + " (" + t + ": " + what + "): " + out;
  }

  // A batched step's sessions (KvStore::BeginSteps) named by tenant t: 1 to 5 entries, each one of
  // its open sessions at its length (or one past it), a handle of another tenant (open or ended)
  // or one never made, or an entry named again. Each entry answers on its own: another tenant's
  // handle exactly as one never made, a wrong length ABORTED, a handle named after an entry of it
  // was admitted ABORTED (a step in flight), t's own OK. The
  // admitted steps then reserve, compute and end one by one, as the service runs them; reserving
  // for one never evicts another of the same call. What broke, or "".
  // One entry of a batched step by tenant t.
  struct BatchEntry {
    Made* own = nullptr;          // t's session, or
    const Made* other = nullptr;  // another tenant's entry, or neither: the handle never made.
    std::optional<int64_t> length;
    std::string handle;
  };
  std::vector<BatchEntry> BatchEntries(Choices& c, const std::string& t) {
    std::vector<BatchEntry> entries(1 + c.Below(5));
    for (size_t i = 0; i < entries.size(); ++i) {
      BatchEntry& e = entries[i];
      const uint64_t pick = c.Below(8);
      if (pick == 0 && i > 0) {
        e = entries[c.Below(i)];  // Named again.
        continue;
      }
      if (pick < 5 && (e.own = Pick(c, t, KvKind::kSession)) != nullptr) {
        e.length = c.OneIn(6) ? e.own->length + 1 : e.own->length;
      } else {
        std::vector<const Made*> theirs;
        for (const Made& m : made) {
          if (m.tenant != t) theirs.push_back(&m);
        }
        if (!theirs.empty() && c.Below(3) != 0) e.other = theirs[c.Below(theirs.size())];
      }
      e.handle = e.own ? e.own->handle : e.other ? e.other->handle : never;
    }
    return entries;
  }

  std::string BatchedSteps(Choices& c, const std::string& t, std::string* what) {
    const std::vector<BatchEntry> entries = BatchEntries(c, t);
    std::vector<KvStore::StepBegin> begins;
    for (const BatchEntry& e : entries) begins.push_back({e.handle, e.length});
    *what = "batched steps of " + std::to_string(entries.size());
    auto got = store->BeginSteps(begins, t);
    if (got.size() != entries.size()) {
      return "BeginSteps answered " + std::to_string(got.size()) + " of " +
             std::to_string(entries.size()) + " entries; ";
    }
    std::string out;
    const auto expect = [&](size_t i, const Status& st, StatusCode want, const std::string& why) {
      if (st.code() != want) {
        out += "batched entry " + std::to_string(i) + " (" + why + ") answered " +
               CodeName(st.code()) + " '" + st.message() + "', expected " + CodeName(want) + "; ";
      }
    };
    const Status unknown = store->BeginStep(never, std::nullopt, t).status();
    std::set<std::string> busy;  // Handles an earlier entry got admitted: a step in flight.
    for (size_t i = 0; i < entries.size(); ++i) {
      const BatchEntry& e = entries[i];
      const Status st = got[i].status();
      if (busy.count(begins[i].handle)) {
        expect(i, st, StatusCode::kAborted, "named again after an admitted entry");
        ++seen["batched: named again"];
      } else if (e.own != nullptr) {
        const bool right = *e.length == e.own->length;
        expect(i, st, right ? StatusCode::kOk : StatusCode::kAborted,
               right ? "its own session" : "a wrong length");
      } else {  // Another tenant's handle, or one never made: as one never made answers.
        const std::string& h = begins[i].handle;
        if (st.code() != unknown.code() || Renamed(st.message(), h, never) != unknown.message()) {
          out += "batched entry " + std::to_string(i) +
                 " (another tenant's or no handle) answered " + CodeName(st.code()) + " '" +
                 st.message() + "', one never made " + CodeName(unknown.code()) + " '" +
                 unknown.message() + "'; ";
        }
        ++seen[e.other ? "batched: another tenant's handle" : "batched: a handle never made"];
      }
      if (st.ok()) busy.insert(begins[i].handle);
    }
    // The admitted steps as the service runs a batched call: each reserves room in turn, every one
    // still in flight, so none may evict another's session; then each computes and ends.
    std::vector<Pending> pending(entries.size());
    std::vector<size_t> admitted;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (got[i].ok() && entries[i].own && entries[i].own->batch <= 3) admitted.push_back(i);
    }
    for (size_t i : admitted) {
      Pending& p = pending[i];
      p.step = std::move(got[i]).value();
      p.session = entries[i].own;
      p.tokens = 1 + static_cast<int64_t>(c.Below(6));
      Reserve(&p);
      std::set<std::string> indexed;
      for (const KvEntryInfo& info : store->Snapshot()) indexed.insert(info.handle);
      for (size_t j : admitted) {
        if (!indexed.count(entries[j].own->handle)) {
          out += "batched entry " + std::to_string(j) + "'s session was evicted by entry " +
                 std::to_string(i) + "'s reservation; ";
        }
      }
    }
    for (size_t i : admitted) {
      const Status st = Finish(&pending[i], !c.OneIn(5));
      if (!st.ok() && st.code() != StatusCode::kResourceExhausted &&
          st.code() != StatusCode::kInvalidArgument) {
        out += "batched entry " + std::to_string(i) + "'s step answered " + CodeName(st.code()) +
               " '" + st.message() + "'; ";
      }
      if (st.code() == StatusCode::kResourceExhausted) ++seen["batched: refused room"];
      if (st.ok()) ++seen["batched: steps"];
    }
    return out;
  }

  // Returns "" (so a skipped call can return it).
  std::string Log(const std::string& t, const std::string& line) {
    if (options.log) *options.log += std::to_string(op - 1) + " " + t + ": " + line + "\n";
    return "";
  }

  std::string End() {
    if (!broken.empty()) return broken;
    store->Clear("the run ends");
    if (std::string b = Books(); !b.empty()) return "after clearing: " + b;
    holds.clear();  // What ended while in use is given back now.
    if (std::string b = Books(); !b.empty()) return "after letting go: " + b;
    for (const std::string& n : options.tenants) {
      if (store->TenantBytes(n) != 0) {
        return "at the end " + n + " holds " + std::to_string(store->TenantBytes(n)) + " bytes";
      }
    }
    return "";
  }
};

KvTenantMachine::KvTenantMachine(const KvTenantOptions& options)
    : state_(std::make_unique<State>(options)) {}

KvTenantMachine::~KvTenantMachine() = default;

std::string KvTenantMachine::Step(const std::function<uint8_t()>& byte) {
  Choices choices([&byte](uint8_t* b) {
    *b = byte();
    return true;
  });
  return state_->Step(choices);
}

std::string KvTenantMachine::End() { return state_->End(); }

const std::map<std::string, int64_t>& KvTenantMachine::seen() const { return state_->seen; }

}  // namespace attnserve::testing
