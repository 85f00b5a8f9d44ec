#pragma once
// Several tenants' calls on one store of the keys and values kept between requests, as a state
// machine over a KvStore and the LibTorch engine: sessions opened, stepped, forked, truncated and
// closed; batched steps (KvStore::BeginSteps) whose entries mix the caller's sessions, other
// tenants' handles and names given twice, each answering on its own, none of a call's sessions
// evicted by another's reservation; memories created and deleted; sizes from the whole int64 range,
// refused with INVALID_ARGUMENT and never wrapped; big memories for pressure; requests holding
// entries; the clock ticked (expiry); each other's handles probed. After every call: every byte
// charged to exactly one tenant (their bytes, and their attnserve_tenant_kv_bytes labels, add up to
// the store's and its gauge's), none over its cap, the store within its budget; a tenant that lost
// an entry to another's need keeps at least its guarantee; room refused only when what other
// tenants keep could not be evicted (their guarantees, what is in use); another tenant's handle,
// open or ended, answers exactly as one never made. Every choice comes from a byte source: a seeded
// generator in tests/unit/kv/kv_property_test.cc, a fuzzer's input in tests/fuzz/fuzz_tenants.cc.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace attnserve::testing {

/// The tenants and store a KvTenantMachine drives.
struct KvTenantOptions {
  /// The tenants file (Tenants::Parse). Default: a capped with a guarantee, b guaranteed, c
  /// guaranteed and capped.
  std::string tenants_json = R"({"tenants": {
      "a": {"kv_max_bytes": 65536, "kv_guaranteed_bytes": 16384},
      "b": {"kv_guaranteed_bytes": 49152},
      "c": {"kv_guaranteed_bytes": 32768, "kv_max_bytes": 98304}}})";
  /// Who calls. Default: the three named and d, which the file does not name.
  std::vector<std::string> tenants = {"a", "b", "c", "d"};
  int64_t budget_bytes = 98304;     ///< KvOptions::budget_bytes (default: the guarantees' sum).
  int64_t max_entry_bytes = 32768;  ///< KvOptions::max_entry_bytes.
  int64_t max_entries = 64;         ///< KvOptions::max_entries.
  double ttl_seconds = 30;          ///< KvOptions::ttl_seconds (each call ticks 10 ms).
  std::string* log = nullptr;       ///< When set, receives one line per operation.
};

/// One store, its tenants, what each has made and what requests hold, and the checks. Not
/// thread-safe (the engine model it uses is made once per process and shared, thread-safe).
class KvTenantMachine {
 public:
  explicit KvTenantMachine(const KvTenantOptions& options = {});
  ~KvTenantMachine();
  KvTenantMachine(const KvTenantMachine&) = delete;
  KvTenantMachine& operator=(const KvTenantMachine&) = delete;

  /// One call by one tenant, every choice read from `byte`, then every check: "" when they held,
  /// else what broke, naming the operation.
  std::string Step(const std::function<uint8_t()>& byte);
  /// Clears the store and lets go of what requests held: "" when the books still add up and every
  /// tenant is then charged nothing, else what broke.
  std::string End();
  /// What happened so far, by kind ("forks", "refused room", "capped", ...), so a test can insist
  /// the checks were not vacuous.
  const std::map<std::string, int64_t>& seen() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace attnserve::testing
