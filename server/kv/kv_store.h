#pragma once
// Keys and values kept on the server between requests: the index of memories and decoding
// sessions, their handles, byte budget, expiry and eviction. The tensors themselves are the
// engine's (KvCache); this file knows only their sizes.
//
// Who pays: every byte counted against the budget is charged to exactly one tenant, so the
// tenants' bytes add up to the store's at every moment and a tenant's kv_max_bytes bounds all it
// keeps. An entry's bytes are its tenant's from Create until its last holder lets go (an entry
// ended while a request uses it included). A session and the forks made from it (and theirs) are
// one family, of one tenant (only the owner finds a session to fork it); a block a member let go
// of while others still read it (a closed or evicted parent's, a truncated or outgrown tail's) is
// the family's, charged to that tenant until its last reader goes. Eviction reclaims such blocks
// with the last member of their family it takes.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "server/core/status.h"
#include "server/engine/attention_model.h"
#include "server/tenants/tenants.h"

namespace attnserve {

using KvClock = std::chrono::steady_clock;

/// Server flags --kv-budget-bytes, --kv-max-entry-bytes, --kv-max-entries, --kv-ttl-seconds.
struct KvOptions {
  int64_t budget_bytes = int64_t{1} << 30;       ///< All memories and sessions together.
  int64_t max_entry_bytes = int64_t{256} << 20;  ///< One memory or session.
  /// Memories and sessions held at once: each costs bookkeeping outside the byte budget, and a
  /// session holds no bytes before its first step.
  int64_t max_entries = 65536;
  double ttl_seconds = 300;  ///< Unused this long: expired.
  /// Checks the options: FAILED_PRECONDITION naming the flag at fault.
  Status Validate() const;
};

enum class KvKind { kMemory, kSession };
const char* KvKindName(KvKind kind);  ///< "memory", "session"

/// Why an entry ended (attnserve_kv_ends_total's reason).
enum class KvEndReason {
  kReleased,  ///< DeleteMemory / CloseSession.
  kEvicted,   ///< Least recently used, to make room under the budget.
  kExpired,   ///< Unused for the TTL.
  kUnloaded,  ///< A reload unloaded its model version.
  kFailed,    ///< Its keys and values could not be computed.
  kShutdown,  ///< The server stopped.
};
const char* KvEndReasonName(KvEndReason reason);  ///< "released", "evicted", ...

/// Counters and gauges the store reports (attnserve_kv_*); any may be empty.
struct KvMetricsHooks {
  std::function<void(int64_t bytes, int64_t memories, int64_t sessions)> on_size;
  std::function<void(KvKind, bool hit)> on_lookup;
  std::function<void(KvKind, KvEndReason)> on_end;
  /// Entries in the index on one model's weights (name, version, weights_hash), after each change;
  /// 0 when the last one ended. Entries pin their weights: a reload that replaces them leaves the
  /// entries on the weights they were made with.
  std::function<void(const ModelSpec&, int64_t entries)> on_model_entries;
  /// Bytes the entries in the index hold by tenant label (Tenants::Label), after each change.
  std::function<void(const std::string& label, int64_t bytes)> on_tenant_bytes;
};

struct KvAccount;
struct KvFamily;
class KvStore;

/// One memory or session. The store's index holds it, and so does every request using it (through
/// its AttendCall::kv); its bytes count against the budget until the last holder lets go, so
/// eviction never frees what a running batch uses.
struct KvEntry {
  ~KvEntry();
  std::string handle;  ///< 32 hex digits.
  KvKind kind = KvKind::kMemory;
  /// The tenant that made it (a fork: the forker's): only it finds the handle, and its bytes count
  /// against that tenant's K/V share.
  std::string tenant = kDefaultTenant;
  std::shared_ptr<const AttentionModel> model;
  std::shared_ptr<KvCache> cache;
  int64_t batch = 0;
  // Guarded by the store's mutex:
  int64_t length = 0;    ///< Tokens held per sequence (applied steps only).
  int64_t capacity = 0;  ///< Tokens per sequence counted against the budget.
  int64_t bytes = 0;     ///< Counted against the budget: `cache`'s bytes at `capacity`.
  bool busy = false;     ///< A session step is in flight.
  bool ready = false;    ///< A memory's keys and values are computed.
  KvClock::time_point last_use;
  std::list<KvEntry*>::iterator lru;  ///< Position in the store's LRU list (front: most recent).
  std::shared_ptr<KvAccount> account;
  /// Its session family (itself alone for a memory or a session never forked): what pays for the
  /// blocks its members share once no member counts them as its own.
  std::shared_ptr<KvFamily> family;
};

/// One entry as the index holds it (KvStore::Snapshot).
struct KvEntryInfo {
  std::string handle;
  KvKind kind = KvKind::kMemory;
  int64_t batch = 0, length = 0, capacity = 0, bytes = 0;
  bool busy = false, ready = false;
};

/// One session step in flight, admitted by KvStore::BeginStep: the session is busy until End, or
/// until this object goes (which ends the step as not applied), so no path can leave a session
/// busy for good. Not thread-safe: the one request that owns it calls it. The store must outlive
/// it.
class KvStep {
 public:
  ~KvStep() { End(false); }
  KvStep(const KvStep&) = delete;
  KvStep& operator=(const KvStep&) = delete;

  const std::shared_ptr<KvEntry>& entry() const { return entry_; }
  /// Tokens per sequence the session held when the step began.
  int64_t length() const { return length_; }
  /// Tokens per sequence its cache holds for the step (after Reserve).
  int64_t capacity() const { return capacity_; }
  /// Reserves room for the step's `tokens` new tokens per sequence (the cache grows by doubling, or
  /// to just what is needed when doubling would not fit), evicting least recently used entries not
  /// in use when the budget needs room. INVALID_ARGUMENT when the session would pass
  /// --kv-max-entry-bytes (or int64); RESOURCE_EXHAUSTED when the budget cannot make room. When it
  /// fails, nothing has changed. Call it once, before the step computes.
  Status Reserve(int64_t tokens);
  /// Ends the step. Applied: the session holds the reserved tokens more. Not applied: its length is
  /// as before, and the bytes it counts are those its cache really holds (a step that failed
  /// before computing gives its reservation back). Calls after the first do nothing.
  void End(bool applied);

 private:
  friend class KvStore;
  KvStep(KvStore* store, std::shared_ptr<KvEntry> entry, int64_t length, int64_t capacity)
      : store_(store), entry_(std::move(entry)), length_(length), capacity_(capacity) {}
  KvStore* store_;
  std::shared_ptr<KvEntry> entry_;
  int64_t length_, capacity_, tokens_ = 0;
  bool ended_ = false;
};

/// The index of memories and sessions. Thread-safe. Every call that reaches an entry names the
/// caller's tenant, with no default: a caller that forgot it would otherwise act as `default`.
class KvStore {
 public:
  /// The store's clock. By default steady_clock and a thread of the store's own that expires idle
  /// entries every second; with `clock` given (tests), no thread: the caller calls ExpireIdle.
  explicit KvStore(KvOptions options, KvMetricsHooks hooks = {},
                   std::function<KvClock::time_point()> clock = nullptr);
  ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  const KvOptions& options() const { return options_; }

  /// This replica: 8 random hex digits chosen when the store is made, the first 8 of each handle
  /// it gives out, so a handle that reaches another replica is known for someone else's. (Where
  /// clients reach the replica is routing, not storage: RequestPipeline::advertised_address.)
  const std::string& replica_id() const { return replica_id_; }

  /// Reserves a new entry of `capacity` tokens per sequence, evicting least recently used entries
  /// not in use when the budget needs room. A memory is not found by Lookup until MarkReady.
  /// INVALID_ARGUMENT for batch < 1, capacity < 0 or over --kv-max-entry-bytes;
  /// RESOURCE_EXHAUSTED at --kv-max-entries or when the budget cannot make room.
  StatusOr<std::shared_ptr<KvEntry>> Create(KvKind kind,
                                            std::shared_ptr<const AttentionModel> model,
                                            std::shared_ptr<KvCache> cache, int64_t batch,
                                            int64_t capacity, const std::string& tenant);
  /// A memory's keys and values are in place: its handle now works. ABORTED, saying why, when the
  /// entry ended while it was computed (a reload unloaded its model, the server stopped).
  Status MarkReady(const std::shared_ptr<KvEntry>& entry, int64_t length);
  /// Drops an entry whose memory could not be computed.
  void Discard(const std::shared_ptr<KvEntry>& entry);

  /// The entry named `handle`, renewing its expiry; NOT_FOUND saying why when there is none (or it
  /// is of the other kind).
  /// Another tenant's entry, held or ended, is NOT_FOUND with the code and message a handle never
  /// made gets: nothing tells a tenant that another's handle exists or existed.
  StatusOr<std::shared_ptr<KvEntry>> Lookup(const std::string& handle, KvKind kind,
                                            const std::string& tenant);

  /// Admits one step on a session and marks it busy: ABORTED when a step is in flight or when
  /// `expected_length` differs from its length; INVALID_ARGUMENT when `expected_length` < 0.
  /// Nothing is reserved yet: the step is validated against its length, then KvStep::Reserve.
  StatusOr<std::unique_ptr<KvStep>> BeginStep(const std::string& handle,
                                              std::optional<int64_t> expected_length,
                                              const std::string& tenant);

  /// A batched step's sessions (AttendRequest.steps), each admitted as BeginStep admits one, all
  /// under one lock: every session admitted is busy before any reserves room, so reserving for one
  /// never evicts another of the same call. One result per entry, in order; a refused entry leaves
  /// its session as it was (a handle named twice: the second is ABORTED, a step in flight). The
  /// tenant has no default: a caller names whose sessions they are.
  struct StepBegin {
    std::string handle;
    std::optional<int64_t> expected_length;
  };
  std::vector<StatusOr<std::unique_ptr<KvStep>>> BeginSteps(const std::vector<StepBegin>& steps,
                                                            const std::string& tenant);

  /// ForkSession: a new session holding the tokens of the session `handle` as it is (and its
  /// model's weights) without copying them: `cache`, the new session's empty cache, shares the
  /// parent's (KvCache::ShareFrom) while the parent is held like a step (ABORTED while one is in
  /// flight). The shared tokens count once: the fork holds 0 bytes until its steps write tokens of
  /// its own, and joins the parent's family (whose tenant pays for blocks its members share once
  /// their session let go of them). Refusals as Create's (--kv-max-entries) and BeginStep's.
  StatusOr<std::shared_ptr<KvEntry>> Fork(const std::string& handle, std::shared_ptr<KvCache> cache,
                                          const std::string& tenant);
  /// The same, the empty cache made by `new_cache` for the parent's model once it is held (the
  /// session is looked up once: attnserve_kv_lookups counts the call once).
  using CacheFactory =
      std::function<StatusOr<std::shared_ptr<KvCache>>(const AttentionModel& parent_model)>;
  StatusOr<std::shared_ptr<KvEntry>> Fork(const std::string& handle, const CacheFactory& new_cache,
                                          const std::string& tenant);
  /// Takes a session back to its first `length` tokens (TruncateSession), renewing its expiry; its
  /// allocation stays. INVALID_ARGUMENT for a length outside 0 to its length, ABORTED while a step
  /// is in flight, NOT_FOUND saying why when it is not held. `entry`, when given, gets the session.
  Status Truncate(const std::string& handle, int64_t length, const std::string& tenant,
                  std::shared_ptr<KvEntry>* entry = nullptr);
  /// Removes an entry at once (DeleteMemory, CloseSession): the bytes it frees, or NOT_FOUND.
  /// Afterwards its maker is told why the handle is gone; any other tenant gets what a handle never
  /// made gets (Lookup).
  StatusOr<int64_t> Release(const std::string& handle, KvKind kind, const std::string& tenant);
  /// Ends every entry whose model is `spec` (name, version and weights): a reload removed that
  /// version. (A reload that replaces a version's weights ends nothing: entries keep theirs.)
  void EndModel(const ModelSpec& spec);
  /// Ends everything (shutdown).
  void Clear(const std::string& reason);
  /// Expires every entry unused for the TTL and not in use now (a step in flight, a memory being
  /// computed, a request holding it), whatever else is in use. The store's own thread calls it
  /// every second.
  void ExpireIdle(KvClock::time_point now);

  /// The tenants' K/V shares (--tenants): a tenant within its kv_guaranteed_bytes never loses an
  /// entry to another tenant's need for room (it keeps at least that much), and one at its
  /// kv_max_bytes is refused more. Default: no guarantees, no caps.
  void SetTenants(std::shared_ptr<const Tenants> tenants);
  /// Bytes charged to `tenant` (see the top of this file: its entries, ended ones still in use
  /// included, and the blocks its session families keep); over all tenants, bytes().
  int64_t TenantBytes(const std::string& tenant) const;

  /// Every entry in the index, copied under one lock; renews nothing (checks and diagnostics).
  std::vector<KvEntryInfo> Snapshot() const;
  /// One entry's fields as they are now, copied under the lock (indexed or not).
  KvEntryInfo Info(const KvEntry& e) const;
  /// Bytes counted against the budget now (entries ended but still in use included).
  int64_t bytes() const;
  /// Entries in the index.
  size_t size() const;
  /// The tokens per sequence a session's cache is grown to for `needed` tokens: at least 16, and
  /// doubling, so T steps copy the history O(log T) times.
  static int64_t GrowCapacity(int64_t capacity, int64_t needed);

 private:
  friend class KvStep;
  // Create, the entry joining `family` (a fork: its parent's), or a family of its own when null.
  StatusOr<std::shared_ptr<KvEntry>> CreateIn(KvKind kind,
                                              std::shared_ptr<const AttentionModel> model,
                                              std::shared_ptr<KvCache> cache, int64_t batch,
                                              int64_t capacity, const std::string& tenant,
                                              std::shared_ptr<KvFamily> family);
  Status Reserve(KvStep* step, int64_t tokens);
  // Lookup and BeginStep under mu_.
  StatusOr<std::shared_ptr<KvEntry>> LookupLocked(const std::string& handle, KvKind kind,
                                                  const std::string& tenant);
  StatusOr<std::unique_ptr<KvStep>> BeginStepLocked(const std::string& handle,
                                                    std::optional<int64_t> expected_length,
                                                    const std::string& tenant);
  void EndStep(KvStep* step, bool applied);
  std::string NewHandle();
  KvClock::time_point Now() const { return clock_ ? clock_() : KvClock::now(); }
  // Under mu_: the entry is still in the index (not released, evicted, expired or ended).
  bool Indexed(const KvEntry* e) const;
  // Under mu_: a step in flight, a memory not computed yet, or a request holding it.
  bool InUse(const KvEntry* e) const;
  void Touch(KvEntry* e);
  // Under mu_: counts `bytes` for `capacity` tokens of `e` against the budget.
  void Recount(KvEntry* e, int64_t capacity, int64_t bytes);
  // Makes room for `need` more bytes of `tenant` by evicting entries not in use, least recently
  // used first: its own, and others' only while their tenant keeps its guarantee; the last of a
  // family taken frees the blocks the family kept too. Refuses past the tenant's cap.
  Status MakeRoom(int64_t need, const KvEntry* keep, const std::string& tenant);
  void Remove(std::string handle, KvEndReason why, const std::string& reason);
  void Tombstone(const std::string& handle, const std::string& tenant, const std::string& reason);
  // Counts an entry in or out of model_entries_ and reports the count.
  void CountModel(const std::shared_ptr<const AttentionModel>& model, int64_t delta);
  void ExpiryLoop();

  const KvOptions options_;
  const KvMetricsHooks hooks_;
  const std::function<KvClock::time_point()> clock_;
  const std::string replica_id_;
  std::shared_ptr<KvAccount> account_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<KvEntry>> entries_;
  std::list<KvEntry*> lru_;                                 // Front: most recently used.
  std::map<const AttentionModel*, int64_t> model_entries_;  // Entries in the index, by weights.
  std::shared_ptr<const Tenants> tenants_ = std::make_shared<Tenants>();
  // Why recent handles are gone, for their maker's NOT_FOUND messages: bounded, oldest dropped
  // first.
  struct Gone {
    std::string tenant, reason;
  };
  std::unordered_map<std::string, Gone> gone_;
  std::deque<std::string> gone_order_;
  bool stop_ = false;
  std::condition_variable stop_cv_;
  std::thread expiry_;
};

}  // namespace attnserve
