#include "server/kv/kv_store.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <unordered_set>
#include <utility>

#include "server/core/checked_math.h"

namespace attnserve {
namespace {

// `bytes` random bytes from the kernel as 2 * bytes lowercase hex digits.
std::string RandomHex(size_t bytes) {
  unsigned char bits[16];
  size_t got = 0;
  bytes = std::min(bytes, sizeof bits);
  while (got < bytes) {
    const ssize_t n = getrandom(bits + got, bytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
    // getrandom(2) blocks until the kernel's pool is seeded and retries on EINTR; other errors
    // cannot happen with these arguments.
  }
  char hex[33];
  for (size_t i = 0; i < bytes; ++i) std::snprintf(hex + 2 * i, 3, "%02x", bits[i]);
  return std::string(hex, 2 * bytes);
}

}  // namespace

/// Bytes counted against the budget, in all and by tenant, shared by the store, its entries and
/// their families: an entry that left the index gives its bytes back when its last holder lets go,
/// a block a family keeps when its last reader does, on whatever thread that is; so it has a mutex
/// of its own, never held while taking the store's.
struct KvAccount {
  // Recursive: a Transfer's function adds on the thread that holds it.
  std::recursive_mutex mu;
  int64_t bytes = 0;
  int64_t entries[2] = {0, 0};                       // In the index, by KvKind.
  std::unordered_map<std::string, int64_t> tenants;  // Bytes by tenant (none: 0).
  std::map<std::string, int64_t> labels;             // The same by metrics label.
  // The tenants' terms, for their labels.
  std::shared_ptr<const Tenants> terms = std::make_shared<Tenants>();
  // Set once, before any entry exists.
  std::function<void(int64_t, int64_t, int64_t)> on_size;
  std::function<void(const std::string&, int64_t)> on_tenant_bytes;
  // While a Transfer runs: the labels it changed, whose gauges are set once it ends.
  int quiet = 0;
  std::set<std::string> touched;

  void Add(const std::string& tenant, int64_t delta_bytes, KvKind kind = KvKind::kMemory,
           int64_t delta_entries = 0) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    AddLocked(tenant, delta_bytes, kind, delta_entries);
  }
  // Runs `fn`, whose adds (on this thread) are one change: other readers of the counts wait for
  // it, and the gauges are set to its net result, not to the steps between.
  template <typename F>
  void Transfer(F&& fn) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    ++quiet;
    fn();
    if (--quiet > 0) return;
    if (on_tenant_bytes) {
      for (const std::string& label : touched) on_tenant_bytes(label, labels[label]);
    }
    touched.clear();
    if (on_size) on_size(bytes, entries[0], entries[1]);
  }
  void AddLocked(const std::string& tenant, int64_t delta_bytes, KvKind kind = KvKind::kMemory,
                 int64_t delta_entries = 0) {
    // The total and the tenant's change together, and the gauges are set in the order the counts
    // changed: the tenants' bytes add up to the store's whenever either is read.
    bytes += delta_bytes;
    entries[static_cast<int>(kind)] += delta_entries;
    if (delta_bytes != 0) {
      auto it = tenants.try_emplace(tenant, 0).first;
      if ((it->second += delta_bytes) == 0) tenants.erase(it);
      const std::string label = terms->Label(tenant);
      const int64_t now = labels[label] += delta_bytes;
      if (quiet > 0) {
        touched.insert(label);
      } else if (on_tenant_bytes) {
        on_tenant_bytes(label, now);
      }
    }
    if (quiet == 0 && on_size) on_size(bytes, entries[0], entries[1]);
  }
  int64_t Get() {
    std::lock_guard<std::recursive_mutex> lock(mu);
    return bytes;
  }
  int64_t Tenant(const std::string& tenant) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    const auto it = tenants.find(tenant);
    return it == tenants.end() ? 0 : it->second;
  }
  int64_t Kept(const KvFamily& family);
  // New terms may label tenants differently: the labels recounted, those now unused set to 0.
  void Relabel(std::shared_ptr<const Tenants> to) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    terms = std::move(to);
    std::map<std::string, int64_t> now;
    for (const auto& [name, b] : tenants) now[terms->Label(name)] += b;
    for (const auto& [label, b] : labels) now.try_emplace(label, 0);
    labels = now;
    if (on_tenant_bytes) {
      for (const auto& [label, b] : labels) on_tenant_bytes(label, b);
    }
  }
};

/// A session, the forks made from it and theirs: the blocks of keys and values its members share
/// (KvCache::ShareFrom) stay within it. A block a member let go of while others still read it
/// counts here (KvLedger, from any thread) until its last reader goes, charged to the family's
/// tenant, the one of all its members. Its counts are guarded by the account's mutex.
struct KvFamily final : public KvLedger {
  KvFamily(std::shared_ptr<KvAccount> a, std::string t)
      : account(std::move(a)), tenant(std::move(t)) {}
  void Charge(int64_t delta_bytes) override {
    std::lock_guard<std::recursive_mutex> lock(account->mu);
    kept += delta_bytes;
    account->AddLocked(tenant, delta_bytes);
  }
  const std::shared_ptr<KvAccount> account;
  const std::string tenant;
  int64_t kept = 0;  // Bytes of blocks no member counts as its own.
};

int64_t KvAccount::Kept(const KvFamily& family) {
  std::lock_guard<std::recursive_mutex> lock(mu);
  return family.kept;
}

KvEntry::~KvEntry() {
  // One change of the counts: its cache leaves its block to the family while forks read it
  // (charged there) and frees the family's blocks it was the last to read (KvFamily), and its own
  // bytes go back. In two, a reader between them saw a block forks still read as free (its own
  // bytes gone first) or counted twice (the family's charge first).
  if (!account) return;
  account->Transfer([this] {
    cache.reset();
    if (bytes) account->AddLocked(tenant, -bytes);
  });
}

const char* KvKindName(KvKind kind) { return kind == KvKind::kMemory ? "memory" : "session"; }

const char* KvEndReasonName(KvEndReason reason) {
  switch (reason) {
    case KvEndReason::kReleased:
      return "released";
    case KvEndReason::kEvicted:
      return "evicted";
    case KvEndReason::kExpired:
      return "expired";
    case KvEndReason::kUnloaded:
      return "unloaded";
    case KvEndReason::kFailed:
      return "failed";
    case KvEndReason::kShutdown:
      return "shutdown";
  }
  return "unknown";
}

Status KvOptions::Validate() const {
  const auto bad = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  if (budget_bytes < 1)
    return bad("--kv-budget-bytes: " + std::to_string(budget_bytes) + "; expected >= 1");
  if (max_entry_bytes < 1 || max_entry_bytes > budget_bytes) {
    return bad("--kv-max-entry-bytes: " + std::to_string(max_entry_bytes) +
               "; expected 1 to --kv-budget-bytes (" + std::to_string(budget_bytes) + ")");
  }
  if (max_entries < 1)
    return bad("--kv-max-entries: " + std::to_string(max_entries) + "; expected >= 1");
  if (!(ttl_seconds > 0))
    return bad("--kv-ttl-seconds: " + std::to_string(ttl_seconds) + "; expected > 0");
  return Status::Ok();
}

KvStore::KvStore(KvOptions options, KvMetricsHooks hooks,
                 std::function<KvClock::time_point()> clock)
    : options_(options),
      hooks_(std::move(hooks)),
      clock_(std::move(clock)),
      replica_id_(RandomHex(4)),
      account_(std::make_shared<KvAccount>()) {
  account_->on_size = hooks_.on_size;
  account_->on_tenant_bytes = hooks_.on_tenant_bytes;
  if (!clock_) expiry_ = std::thread([this] { ExpiryLoop(); });
}

KvStore::~KvStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (expiry_.joinable()) expiry_.join();
  Clear("the server stopped");
}

int64_t KvStore::GrowCapacity(int64_t capacity, int64_t needed) {
  if (needed <= capacity) return capacity;
  const int64_t doubled =
      capacity > std::numeric_limits<int64_t>::max() / 2 ? needed : 2 * capacity;
  return std::max<int64_t>({needed, doubled, 16});
}

std::string KvStore::NewHandle() {
  // The replica's 32 bits, then 96 random ones: guessing a live handle stays hopeless.
  return replica_id_ + RandomHex(12);
}

bool KvStore::Indexed(const KvEntry* e) const {
  const auto it = entries_.find(e->handle);
  return it != entries_.end() && it->second.get() == e;
}

bool KvStore::InUse(const KvEntry* e) const {
  // use_count > 1: a request (its WorkItem or KvStep) holds it besides the index.
  return e->busy || !e->ready || entries_.find(e->handle)->second.use_count() > 1;
}

void KvStore::Touch(KvEntry* e) {
  // Under mu_, for an entry in the index: the LRU list stays ordered by last_use.
  e->last_use = Now();
  lru_.splice(lru_.begin(), lru_, e->lru);
}

void KvStore::Recount(KvEntry* e, int64_t capacity, int64_t bytes) {
  account_->Add(e->tenant, bytes - e->bytes);
  e->bytes = bytes;
  e->capacity = capacity;
}

int64_t KvStore::TenantBytes(const std::string& tenant) const { return account_->Tenant(tenant); }

void KvStore::SetTenants(std::shared_ptr<const Tenants> tenants) {
  std::lock_guard<std::mutex> lock(mu_);
  tenants_ = tenants;
  account_->Relabel(std::move(tenants));
}

Status KvStore::MakeRoom(int64_t need, const KvEntry* keep, const std::string& tenant) {
  // Under mu_. Entries in use are never evicted; nothing is evicted unless that makes room.
  const TenantPolicy& terms = tenants_->Of(tenant);
  const int64_t mine = account_->Tenant(tenant);
  // Every count here is at most the budget (2^50), `need` at most twice one entry: no overflow.
  if (terms.kv_max_bytes > 0 && mine + need > terms.kv_max_bytes) {
    return Status(StatusCode::kResourceExhausted,
                  "tenant '" + tenant + "' holds " + std::to_string(mine) +
                      " bytes of memories and sessions and needs " + std::to_string(need) +
                      " more, over its kv_max_bytes " + std::to_string(terms.kv_max_bytes) +
                      " (guaranteed " + std::to_string(terms.kv_guaranteed_bytes) +
                      ", --tenants); close its sessions or delete its memories");
  }
  // The victims, least recently used first: the tenant's own entries, and another tenant's only
  // while what that tenant keeps stays at or above its guarantee. Evicting an entry frees at most
  // its own bytes and the blocks its family keeps (those it was the last to read; its own block
  // goes to the family instead while forks read it): counted so, with the family's blocks at the
  // first of its members taken, another tenant never goes below its guarantee.
  std::unordered_map<std::string, int64_t> kept;
  std::unordered_set<const KvFamily*> families;
  std::vector<std::string> victims;
  int64_t held = account_->Get(), freeable = 0;
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    const KvEntry* e = *it;
    if (e == keep || InUse(e)) continue;
    const bool first = !families.count(e->family.get());
    const int64_t frees = e->bytes + (first ? account_->Kept(*e->family) : 0);
    if (e->tenant != tenant) {
      int64_t& left = kept.try_emplace(e->tenant, account_->Tenant(e->tenant)).first->second;
      if (left - frees < tenants_->Of(e->tenant).kv_guaranteed_bytes) continue;
      left -= frees;
    }
    families.insert(e->family.get());
    victims.push_back(e->handle);
    freeable += frees;
  }
  if (held + need - freeable > options_.budget_bytes) {
    return Status(
        StatusCode::kResourceExhausted,
        "key/value memory is full: " + std::to_string(held) +
            " bytes held by memories and sessions (" + std::to_string(held - freeable) +
            " in use or guaranteed to other tenants), " + std::to_string(need) +
            " more needed, budget " + std::to_string(options_.budget_bytes) +
            " (server flag --kv-budget-bytes); close sessions or delete memories, or retry later");
  }
  for (size_t i = 0; i < victims.size() && held + need > options_.budget_bytes; ++i) {
    Remove(victims[i], KvEndReason::kEvicted,
           std::string("evicted (least recently used, to make room under --kv-budget-bytes ") +
               std::to_string(options_.budget_bytes) + ")");
    // Freed now (only the index held it), except blocks its forks still read: they count on.
    held = account_->Get();
  }
  if (held + need > options_.budget_bytes) {
    return Status(StatusCode::kResourceExhausted,
                  "key/value memory is full: " + std::to_string(held) +
                      " bytes held by memories, sessions and the blocks their forks share, " +
                      std::to_string(need) + " more needed, budget " +
                      std::to_string(options_.budget_bytes) +
                      " (server flag --kv-budget-bytes); close sessions or delete memories, or "
                      "retry later");
  }
  return Status::Ok();
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::Create(KvKind kind,
                                                   std::shared_ptr<const AttentionModel> model,
                                                   std::shared_ptr<KvCache> cache, int64_t batch,
                                                   int64_t capacity, const std::string& tenant) {
  return CreateIn(kind, std::move(model), std::move(cache), batch, capacity, tenant, nullptr);
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::CreateIn(KvKind kind,
                                                     std::shared_ptr<const AttentionModel> model,
                                                     std::shared_ptr<KvCache> cache, int64_t batch,
                                                     int64_t capacity, const std::string& tenant,
                                                     std::shared_ptr<KvFamily> family) {
  if (batch < 1 || capacity < 0) {
    return InvalidArgument(std::string(KvKindName(kind)) + ": batch " + std::to_string(batch) +
                           " of " + std::to_string(capacity) +
                           " tokens; allowed: batch >= 1, tokens >= 0");
  }
  const std::optional<int64_t> bytes = cache->BytesFor(batch, capacity);
  if (!bytes || *bytes > options_.max_entry_bytes) {
    return InvalidArgument(std::string(KvKindName(kind)) + ": " + std::to_string(batch) + " x " +
                           std::to_string(capacity) + " tokens need " +
                           (bytes ? std::to_string(*bytes) : "more than 2^63") +
                           " bytes, over the " + std::to_string(options_.max_entry_bytes) +
                           " one entry may hold (server flag --kv-max-entry-bytes)");
  }
  auto e = std::make_shared<KvEntry>();
  e->kind = kind;
  e->model = std::move(model);
  e->cache = std::move(cache);
  e->batch = batch;
  e->capacity = capacity;
  e->ready = kind == KvKind::kSession;
  e->tenant = tenant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(entries_.size()) >= options_.max_entries) {
      return Status(StatusCode::kResourceExhausted,
                    "key/value entries are full: " + std::to_string(entries_.size()) +
                        " memories and sessions held, the most this server keeps (server flag "
                        "--kv-max-entries); close sessions or delete memories, or retry later");
    }
    RETURN_IF_ERROR(MakeRoom(*bytes, nullptr, tenant));
    do e->handle = NewHandle();
    while (entries_.count(e->handle) || gone_.count(e->handle));
    e->account = account_;
    e->family = family ? std::move(family) : std::make_shared<KvFamily>(account_, tenant);
    e->cache->set_ledger(e->family);
    e->bytes = *bytes;
    e->last_use = Now();
    lru_.push_front(e.get());
    e->lru = lru_.begin();
    entries_[e->handle] = e;
    account_->Add(tenant, *bytes, kind, 1);
    CountModel(e->model, 1);
  }
  return e;
}

Status KvStore::MarkReady(const std::shared_ptr<KvEntry>& entry, int64_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Indexed(entry.get())) {
    const auto g = gone_.find(entry->handle);
    return Status(StatusCode::kAborted,
                  "memory '" + entry->handle +
                      "' ended before its keys and values were in "
                      "place: " +
                      (g == gone_.end() ? std::string("gone") : g->second.reason) +
                      "; create it again");
  }
  entry->length = length;
  entry->ready = true;
  Touch(entry.get());
  return Status::Ok();
}

void KvStore::Discard(const std::shared_ptr<KvEntry>& entry) {
  std::lock_guard<std::mutex> lock(mu_);
  Remove(entry->handle, KvEndReason::kFailed, "its keys and values could not be computed");
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::Lookup(const std::string& handle, KvKind kind,
                                                   const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  return LookupLocked(handle, kind, tenant);
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::LookupLocked(const std::string& handle, KvKind kind,
                                                         const std::string& tenant) {
  auto it = entries_.find(handle);
  // Another tenant's entry, there or gone, is not there for this one: not found, as if never made
  // (the same code and message), so a tenant learns nothing of others' handles.
  if (it != entries_.end() && it->second->tenant != tenant) it = entries_.end();
  auto g = gone_.find(handle);
  if (g != gone_.end() && g->second.tenant != tenant) g = gone_.end();
  if (it == entries_.end() || !it->second->ready || it->second->kind != kind) {
    if (hooks_.on_lookup) hooks_.on_lookup(kind, false);
    std::string why;
    if (it != entries_.end() && it->second->kind != kind) {
      why = std::string("is a ") + KvKindName(it->second->kind) + ", not a " + KvKindName(kind);
    } else if (g != gone_.end() && !entries_.count(handle)) {
      why = g->second.reason;
    } else if (handle.size() == 32 && handle.compare(0, replica_id_.size(), replica_id_) != 0) {
      why = "made by replica " + handle.substr(0, replica_id_.size()) +
            " (its handle's first 8 hex digits), but this is replica " + replica_id_ +
            ": send a memory's or session's calls to the replica that made it (KvHandle.replica; "
            "the attnserve clients do, docs/kv.md \"Sessions across replicas\"); if that replica "
            "stopped or restarted, what it held is gone: make it again";
    } else {
      why =
          "unknown: this server holds no memory or session with this handle (they live on the "
          "replica that created them, until they expire, are evicted or closed)";
    }
    return Status(StatusCode::kNotFound,
                  std::string(KvKindName(kind)) + " '" + handle + "': " + why);
  }
  if (hooks_.on_lookup) hooks_.on_lookup(kind, true);
  Touch(it->second.get());
  return it->second;
}

StatusOr<std::unique_ptr<KvStep>> KvStore::BeginStep(const std::string& handle,
                                                     std::optional<int64_t> expected_length,
                                                     const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  return BeginStepLocked(handle, expected_length, tenant);
}

std::vector<StatusOr<std::unique_ptr<KvStep>>> KvStore::BeginSteps(
    const std::vector<StepBegin>& steps, const std::string& tenant) {
  std::vector<StatusOr<std::unique_ptr<KvStep>>> out;
  out.reserve(steps.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (const StepBegin& s : steps)
    out.push_back(BeginStepLocked(s.handle, s.expected_length, tenant));
  return out;
}

StatusOr<std::unique_ptr<KvStep>> KvStore::BeginStepLocked(const std::string& handle,
                                                           std::optional<int64_t> expected_length,
                                                           const std::string& tenant) {
  if (expected_length && *expected_length < 0) {
    return InvalidArgument(
        "session_length: " + std::to_string(*expected_length) +
        "; allowed: >= 0, the tokens the session holds before this step (or unset)");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> e, LookupLocked(handle, KvKind::kSession, tenant));
  if (e->busy) {
    return Status(StatusCode::kAborted,
                  "session '" + handle +
                      "': a step is already in flight; send a "
                      "session's steps one at a time, each after the previous one's answer");
  }
  if (expected_length && *expected_length != e->length) {
    return Status(StatusCode::kAborted,
                  "session '" + handle + "': session_length " + std::to_string(*expected_length) +
                      " expected, but it holds " + std::to_string(e->length) + " tokens");
  }
  e->busy = true;
  const int64_t length = e->length, capacity = e->capacity;
  return std::unique_ptr<KvStep>(new KvStep(this, std::move(e), length, capacity));
}

Status KvStep::Reserve(int64_t tokens) { return store_->Reserve(this, tokens); }

void KvStep::End(bool applied) {
  if (ended_) return;
  ended_ = true;
  store_->EndStep(this, applied);
}

Status KvStore::Reserve(KvStep* step, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  KvEntry* e = step->entry_.get();
  const auto what = [&] {  // Made only for a refusal: a step's reservation is on the hot path.
    return "session '" + e->handle + "': " + std::to_string(step->length_) + " + " +
           std::to_string(tokens) + " tokens (x " + std::to_string(e->batch) + " sequences)";
  };
  const std::optional<int64_t> needed =
      tokens < 0 ? std::nullopt : CheckedAdd(step->length_, tokens);
  if (!needed) return InvalidArgument(what() + ": not a token count (negative or over 2^63)");
  // Tokens in blocks shared with forks are counted once, by their own: the session counts the
  // tokens of its own allocation (KvCache::PlanAppend).
  const KvCache::Plan plan = e->cache->PlanAppend(step->length_);
  const int64_t own_needed = *needed - plan.shared;
  if (own_needed <= plan.own) {
    step->tokens_ = tokens;
    step->capacity_ = e->capacity;
    return Status::Ok();
  }
  // Doubled when that fits (one entry's limit, the budget), else just what the step needs. A
  // replaced allocation that forks still read stays counted until the step ends.
  Status refused;
  for (const int64_t own : {GrowCapacity(plan.own, own_needed), own_needed}) {
    const std::optional<int64_t> bytes = e->cache->BytesFor(e->batch, own);
    if (!bytes || *bytes > options_.max_entry_bytes) {
      refused =
          InvalidArgument(what() + " need " + (bytes ? std::to_string(*bytes) : "more than 2^63") +
                          " bytes, over the " + std::to_string(options_.max_entry_bytes) +
                          " one entry may hold (server flag --kv-max-entry-bytes)");
      continue;
    }
    const int64_t charge = plan.retained ? e->bytes + *bytes : *bytes;  // <= 2 x 2^50: no overflow
    refused = MakeRoom(charge - e->bytes, e, e->tenant);
    if (!refused.ok()) continue;
    Recount(e, plan.shared + own, charge);
    step->tokens_ = tokens;
    step->capacity_ = plan.shared + own;
    return Status::Ok();
  }
  return refused;
}

void KvStore::EndStep(KvStep* step, bool applied) {
  std::lock_guard<std::mutex> lock(mu_);
  KvEntry* e = step->entry_.get();
  e->busy = false;
  if (applied) e->length = step->length_ + step->tokens_;
  // What the cache holds now: the reservation when the step computed, as before when it failed
  // before growing it. Counted for ended entries too: their bytes go back when the last holder
  // goes.
  const int64_t held = std::max(e->cache->AllocatedTokens(), applied ? step->capacity_ : 0);
  const int64_t bytes =
      e->cache->BytesFor(e->batch, held - e->cache->SharedTokens()).value_or(e->bytes);
  if (held != e->capacity || bytes != e->bytes) Recount(e, held, bytes);
  if (Indexed(e)) Touch(e);
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::Fork(const std::string& handle,
                                                 std::shared_ptr<KvCache> cache,
                                                 const std::string& tenant) {
  return Fork(
      handle, [&cache](const AttentionModel&) { return std::move(cache); }, tenant);
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::Fork(const std::string& handle,
                                                 const CacheFactory& new_cache,
                                                 const std::string& tenant) {
  // Held like a step (busy) and ended not applied: no step changes the parent while the fork is
  // made, and it is as it was when the fork returns.
  ASSIGN_OR_RETURN(std::unique_ptr<KvStep> hold, BeginStep(handle, std::nullopt, tenant));
  const KvEntry& parent = *hold->entry();
  ASSIGN_OR_RETURN(std::shared_ptr<KvCache> cache, new_cache(*parent.model));
  // The parent is this tenant's (BeginStep found it): the fork joins its family.
  ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> child,
                   CreateIn(KvKind::kSession, parent.model, std::move(cache), parent.batch, 0,
                            tenant, parent.family));
  const Status shared = child->cache->ShareFrom(*parent.cache, hold->length());
  if (!shared.ok()) {
    Discard(child);
    return shared;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!Indexed(child.get())) {
    const auto gone = gone_.find(child->handle);
    return Status(StatusCode::kAborted,
                  "session '" + handle + "': its fork ended while being made: " +
                      (gone == gone_.end() ? std::string("ended") : gone->second.reason));
  }
  child->length = hold->length();
  // All of its tokens are the parent's, shared: none counted for it until it writes its own.
  child->capacity = child->cache->AllocatedTokens();
  return child;
}

Status KvStore::Truncate(const std::string& handle, int64_t length, const std::string& tenant,
                         std::shared_ptr<KvEntry>* entry) {
  ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> e, Lookup(handle, KvKind::kSession, tenant));
  if (entry != nullptr) *entry = e;
  std::lock_guard<std::mutex> lock(mu_);
  if (!Indexed(e.get())) {
    const auto gone = gone_.find(handle);
    return Status(StatusCode::kNotFound, "session '" + handle + "': " +
                                             (gone == gone_.end() ? "ended" : gone->second.reason));
  }
  if (e->busy) {
    return Status(StatusCode::kAborted,
                  "session '" + handle + "': a step is in flight; truncate after its answer");
  }
  if (length < 0 || length > e->length) {
    return InvalidArgument("length: " + std::to_string(length) + "; allowed: 0 to " +
                           std::to_string(e->length) + ", the tokens session '" + handle +
                           "' holds");
  }
  e->length = length;
  return Status::Ok();
}

StatusOr<int64_t> KvStore::Release(const std::string& handle, KvKind kind,
                                   const std::string& tenant) {
  ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> e, Lookup(handle, kind, tenant));
  std::lock_guard<std::mutex> lock(mu_);
  Remove(handle, KvEndReason::kReleased,
         kind == KvKind::kMemory ? "deleted (DeleteMemory)" : "closed (CloseSession)");
  return e->bytes;
}

void KvStore::EndModel(const ModelSpec& spec) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> ended;
  for (const auto& [handle, e] : entries_) {
    const ModelSpec& m = e->model->spec();
    if (m.name == spec.name && m.version == spec.version && m.weights_hash == spec.weights_hash) {
      ended.push_back(handle);
    }
  }
  for (const std::string& h : ended) {
    Remove(h, KvEndReason::kUnloaded,
           "ended: model '" + spec.name + "' version " + std::to_string(spec.version) + " (" +
               spec.weights_hash + ") was unloaded by a reload");
  }
}

void KvStore::Clear(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  while (!entries_.empty())
    Remove(entries_.begin()->first, KvEndReason::kShutdown, "ended: " + reason);
}

void KvStore::ExpireIdle(KvClock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto ttl = std::chrono::duration_cast<KvClock::duration>(
      std::chrono::duration<double>(options_.ttl_seconds));
  // The list is ordered by last use, least recent at the back: walk forward from there until an
  // entry is recent, stepping over (not stopping at) entries in use.
  for (auto it = lru_.end(); it != lru_.begin();) {
    const auto at = std::prev(it);
    KvEntry* e = *at;
    if (now - e->last_use < ttl) break;
    if (InUse(e)) {
      it = at;
      continue;
    }
    char ttl_text[32];
    std::snprintf(ttl_text, sizeof ttl_text, "%g", options_.ttl_seconds);
    Remove(e->handle, KvEndReason::kExpired,
           std::string("expired (unused for ") + ttl_text +
               " s, server flag --kv-ttl-seconds)");  // Erases *at only.
  }
}

// `handle` by value: it may be the key erased.
void KvStore::Remove(std::string handle, KvEndReason why, const std::string& reason) {
  // Under mu_. The entry's bytes go back to the budget when its last holder lets go.
  const auto it = entries_.find(handle);
  if (it == entries_.end()) return;
  // Its bytes stay charged to its tenant until then (~KvEntry).
  const KvKind kind = it->second->kind;
  const std::string tenant = it->second->tenant;
  lru_.erase(it->second->lru);
  CountModel(it->second->model, -1);
  entries_.erase(it);
  Tombstone(handle, tenant, reason);
  account_->Add(tenant, 0, kind, -1);
  if (hooks_.on_end) hooks_.on_end(kind, why);
}

void KvStore::CountModel(const std::shared_ptr<const AttentionModel>& model, int64_t delta) {
  // Under mu_, so the reports come in the order of the counts.
  if (!model) return;
  auto it = model_entries_.try_emplace(model.get(), 0).first;
  it->second += delta;
  const int64_t now = it->second;
  if (now == 0) model_entries_.erase(it);
  if (hooks_.on_model_entries) hooks_.on_model_entries(model->spec(), now);
}

void KvStore::Tombstone(const std::string& handle, const std::string& tenant,
                        const std::string& reason) {
  static constexpr size_t kRemembered = 16384;
  if (gone_order_.size() >= kRemembered) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
  gone_[handle] = Gone{tenant, reason};
  gone_order_.push_back(handle);
}

std::vector<KvEntryInfo> KvStore::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<KvEntryInfo> out;
  out.reserve(entries_.size());
  for (const auto& [handle, e] : entries_) {
    out.push_back({handle, e->kind, e->batch, e->length, e->capacity, e->bytes, e->busy, e->ready});
  }
  return out;
}

KvEntryInfo KvStore::Info(const KvEntry& e) const {
  std::lock_guard<std::mutex> lock(mu_);
  return {e.handle, e.kind, e.batch, e.length, e.capacity, e.bytes, e.busy, e.ready};
}

int64_t KvStore::bytes() const { return account_->Get(); }

size_t KvStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void KvStore::ExpiryLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    stop_cv_.wait_for(lock, std::chrono::seconds(1));
    if (stop_) break;
    lock.unlock();
    ExpireIdle(Now());
    lock.lock();
  }
}

}  // namespace attnserve
