#include "server/kv_store.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace attnserve {

/// Bytes counted against the budget, shared by the store and its entries: an entry that left the
/// index gives its bytes back when its last holder lets go.
struct KvAccount {
  std::mutex mu;
  int64_t bytes = 0;
  int64_t entries[2] = {0, 0};  // In the index, by KvKind.
  std::function<void(int64_t, int64_t, int64_t)> on_size;  // Set once, before any entry exists.
  void Add(int64_t delta_bytes, KvKind kind = KvKind::kMemory, int64_t delta_entries = 0) {
    std::lock_guard<std::mutex> lock(mu);  // Gauges set in the order the counts changed.
    bytes += delta_bytes;
    entries[static_cast<int>(kind)] += delta_entries;
    if (on_size) on_size(bytes, entries[0], entries[1]);
  }
  int64_t Get() {
    std::lock_guard<std::mutex> lock(mu);
    return bytes;
  }
};

KvEntry::~KvEntry() {
  if (account && bytes) account->Add(-bytes);
}

const char* KvKindName(KvKind kind) { return kind == KvKind::kMemory ? "memory" : "session"; }

const char* KvEndReasonName(KvEndReason reason) {
  switch (reason) {
    case KvEndReason::kReleased: return "released";
    case KvEndReason::kEvicted: return "evicted";
    case KvEndReason::kExpired: return "expired";
    case KvEndReason::kUnloaded: return "unloaded";
    case KvEndReason::kFailed: return "failed";
    case KvEndReason::kShutdown: return "shutdown";
  }
  return "unknown";
}

Status KvOptions::Validate() const {
  const auto bad = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  if (budget_bytes < 1) return bad("--kv-budget-bytes: " + std::to_string(budget_bytes) + "; expected >= 1");
  if (max_entry_bytes < 1 || max_entry_bytes > budget_bytes) {
    return bad("--kv-max-entry-bytes: " + std::to_string(max_entry_bytes) + "; expected 1 to --kv-budget-bytes (" +
               std::to_string(budget_bytes) + ")");
  }
  if (!(ttl_seconds > 0)) return bad("--kv-ttl-seconds: " + std::to_string(ttl_seconds) + "; expected > 0");
  return Status::Ok();
}

KvStore::KvStore(KvOptions options, KvMetricsHooks hooks)
    : options_(options), hooks_(std::move(hooks)), account_(std::make_shared<KvAccount>()) {
  account_->on_size = hooks_.on_size;
  expiry_ = std::thread([this] { ExpiryLoop(); });
}

KvStore::~KvStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  expiry_.join();
  Clear("the server stopped");
}

int64_t KvStore::GrowCapacity(int64_t capacity, int64_t needed) {
  if (needed <= capacity) return capacity;
  return std::max<int64_t>({needed, 2 * capacity, 16});
}

std::string KvStore::NewHandle() {
  unsigned char bits[16];
  size_t got = 0;
  while (got < sizeof bits) {
    const ssize_t n = getrandom(bits + got, sizeof bits - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
    // getrandom(2) blocks until the kernel's pool is seeded and retries on EINTR; other errors
    // cannot happen with these arguments.
  }
  char hex[33];
  for (size_t i = 0; i < sizeof bits; ++i) std::snprintf(hex + 2 * i, 3, "%02x", bits[i]);
  return std::string(hex, 32);
}

void KvStore::Touch(KvEntry* e, KvClock::time_point now) {
  e->last_use = now;
  lru_.splice(lru_.begin(), lru_, e->lru);
}

Status KvStore::MakeRoom(int64_t need, const KvEntry* keep) {
  // Under mu_. Entries still used by a request (use_count > 1: a WorkItem holds them), with a step
  // in flight, or not yet computed are never evicted; nothing is evicted unless that makes room.
  const auto evictable = [&](const KvEntry* e) {
    return e != keep && !e->busy && e->ready && entries_.find(e->handle)->second.use_count() == 1;
  };
  int64_t held = account_->Get(), freeable = 0;
  for (const KvEntry* e : lru_) {
    if (evictable(e)) freeable += e->bytes;
  }
  if (held + need - freeable > options_.budget_bytes) {
    return Status(StatusCode::kResourceExhausted,
                  "key/value memory is full: " + std::to_string(held) + " bytes held by memories and "
                  "sessions (" + std::to_string(held - freeable) + " in use), " + std::to_string(need) +
                  " more needed, budget " + std::to_string(options_.budget_bytes) +
                  " (server flag --kv-budget-bytes); close sessions or delete memories, or retry later");
  }
  for (auto it = lru_.end(); held + need > options_.budget_bytes && it != lru_.begin();) {
    --it;
    KvEntry* e = *it;
    if (!evictable(e)) continue;
    const std::string handle = e->handle;
    held -= e->bytes;  // Freed now: only the index held it.
    it = std::next(it);  // Remove erases *it: step past it first.
    Remove(handle, KvEndReason::kEvicted, std::string("evicted (least recently used, to make room under --kv-budget-bytes ") +
                       std::to_string(options_.budget_bytes) + ")");
  }
  return Status::Ok();
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::Create(KvKind kind, std::shared_ptr<const AttentionModel> model,
                                                   std::shared_ptr<KvCache> cache, int64_t batch,
                                                   int64_t capacity) {
  const int64_t bytes = cache->BytesFor(batch, capacity);
  if (bytes > options_.max_entry_bytes) {
    return InvalidArgument(std::string(KvKindName(kind)) + ": " + std::to_string(batch) + " x " +
                           std::to_string(capacity) + " tokens need " + std::to_string(bytes) +
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(MakeRoom(bytes, nullptr));
    do e->handle = NewHandle(); while (entries_.count(e->handle) || gone_.count(e->handle));
    e->account = account_;
    e->bytes = bytes;
    e->last_use = KvClock::now();
    lru_.push_front(e.get());
    e->lru = lru_.begin();
    entries_[e->handle] = e;
  }
  account_->Add(bytes, kind, 1);
  return e;
}

void KvStore::MarkReady(const std::shared_ptr<KvEntry>& entry, int64_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  entry->length = length;
  entry->ready = true;
  Touch(entry.get(), KvClock::now());
}

void KvStore::Discard(const std::shared_ptr<KvEntry>& entry) {
  std::lock_guard<std::mutex> lock(mu_);
  Remove(entry->handle, KvEndReason::kFailed, "its keys and values could not be computed");
}

StatusOr<std::shared_ptr<KvEntry>> KvStore::Lookup(const std::string& handle, KvKind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = entries_.find(handle);
  if (it == entries_.end() || !it->second->ready || it->second->kind != kind) {
    if (hooks_.on_lookup) hooks_.on_lookup(kind, false);
    std::string why;
    if (it != entries_.end() && it->second->kind != kind) {
      why = std::string("is a ") + KvKindName(it->second->kind) + ", not a " + KvKindName(kind);
    } else if (const auto g = gone_.find(handle); g != gone_.end()) {
      why = g->second;
    } else {
      why = "unknown: this server holds no memory or session with this handle (they live on the "
            "replica that created them, until they expire, are evicted or closed)";
    }
    return Status(StatusCode::kNotFound, std::string(KvKindName(kind)) + " '" + handle + "': " + why);
  }
  if (hooks_.on_lookup) hooks_.on_lookup(kind, true);
  Touch(it->second.get(), KvClock::now());
  return it->second;
}

StatusOr<KvStep> KvStore::BeginStep(const std::string& handle, int64_t tokens, int64_t expected_length) {
  ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> e, Lookup(handle, KvKind::kSession));
  std::lock_guard<std::mutex> lock(mu_);
  if (e->busy) {
    return Status(StatusCode::kAborted, "session '" + handle + "': a step is already in flight; send a "
                  "session's steps one at a time, each after the previous one's answer");
  }
  if (expected_length >= 0 && expected_length != e->length) {
    return Status(StatusCode::kAborted, "session '" + handle + "': session_length " +
                  std::to_string(expected_length) + " expected, but it holds " +
                  std::to_string(e->length) + " tokens");
  }
  const int64_t capacity = GrowCapacity(e->capacity, e->length + tokens);
  if (capacity != e->capacity) {
    const int64_t bytes = e->cache->BytesFor(e->batch, capacity);
    if (bytes > options_.max_entry_bytes) {
      return InvalidArgument("session '" + handle + "': " + std::to_string(e->length) + " + " +
                             std::to_string(tokens) + " tokens (x " + std::to_string(e->batch) +
                             " sequences) need " + std::to_string(bytes) + " bytes, over the " +
                             std::to_string(options_.max_entry_bytes) +
                             " one entry may hold (server flag --kv-max-entry-bytes)");
    }
    RETURN_IF_ERROR(MakeRoom(bytes - e->bytes, e.get()));
    account_->Add(bytes - e->bytes);
    e->bytes = bytes;
    e->capacity = capacity;
  }
  e->busy = true;
  return KvStep{e, e->length, e->capacity};
}

void KvStore::EndStep(const KvStep& step, bool ok, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  step.entry->busy = false;
  if (ok) step.entry->length = step.length + tokens;
  if (entries_.count(step.entry->handle)) Touch(step.entry.get(), KvClock::now());
}

StatusOr<int64_t> KvStore::Release(const std::string& handle, KvKind kind) {
  ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> e, Lookup(handle, kind));
  std::lock_guard<std::mutex> lock(mu_);
  Remove(handle, KvEndReason::kReleased, kind == KvKind::kMemory ? "deleted (DeleteMemory)" : "closed (CloseSession)");
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
    Remove(h, KvEndReason::kUnloaded, "ended: model '" + spec.name + "' version " + std::to_string(spec.version) + " (" +
                  spec.weights_hash + ") was unloaded by a reload");
  }
}

void KvStore::Clear(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  while (!entries_.empty()) Remove(entries_.begin()->first, KvEndReason::kShutdown, "ended: " + reason);
}

void KvStore::ExpireIdle(KvClock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto ttl = std::chrono::duration_cast<KvClock::duration>(std::chrono::duration<double>(options_.ttl_seconds));
  // Least recently used last: expired entries are at the back.
  while (!lru_.empty() && now - lru_.back()->last_use >= ttl && !lru_.back()->busy) {
    KvEntry* e = lru_.back();
    Remove(e->handle, KvEndReason::kExpired,
           "expired (unused for " + std::to_string(static_cast<int64_t>(options_.ttl_seconds)) +
               " s, server flag --kv-ttl-seconds)");
  }
}

// `handle` by value: it may be the key erased.
void KvStore::Remove(std::string handle, KvEndReason why, const std::string& reason) {
  // Under mu_. The entry's bytes go back to the budget when its last holder lets go.
  const auto it = entries_.find(handle);
  if (it == entries_.end()) return;
  const KvKind kind = it->second->kind;
  lru_.erase(it->second->lru);
  entries_.erase(it);
  Tombstone(handle, reason);
  account_->Add(0, kind, -1);
  if (hooks_.on_end) hooks_.on_end(kind, why);
}

void KvStore::Tombstone(const std::string& handle, const std::string& reason) {
  static constexpr size_t kRemembered = 16384;
  if (gone_order_.size() >= kRemembered) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
  gone_[handle] = reason;
  gone_order_.push_back(handle);
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
    ExpireIdle(KvClock::now());
    lock.lock();
  }
}

}  // namespace attnserve
