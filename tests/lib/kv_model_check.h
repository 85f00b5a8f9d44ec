#pragma once
// A model check of the keys and values kept between requests. It decodes a stream of
// choices into operations on a KvStore and the LibTorch engine, in the order the service runs them:
// sessions opened, stepped (BeginStep, validation, Reserve, computed or failed at each stage,
// several in flight, racing on one session), closed; memories created (validated, or raw with any
// int64 sizes), computed or failed, queried, held by a request, deleted; clock ticks with expiry;
// reloads that unload a model; shutdown. After every operation it checks the store against a plain
// reference model of what it must hold: the same entries with the same lengths, capacities and
// bytes; bytes held = the sum over live entries (and ended ones still held) = the
// attnserve_kv_bytes gauge, never negative, never over the budget; what was evicted or expired and
// why; a failed operation changes nothing; a removed entry answers NOT_FOUND with its reason; each
// computed answer equals its one-call form (a session step: one causal self-attention over the
// applied tokens, at positions 0 onwards for the decoder layer among the models). Used by the
// libFuzzer target tests/fuzz/fuzz_kv_store.cc and tests/unit/kv/kv_property_test.cc.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace attnserve {
class Parallel;
}

namespace attnserve::testing {

/// Where the operations' choices come from: a fuzzer's bytes, or a seeded generator.
class Choices {
 public:
  /// `next` gives one byte, or false when there are no more.
  explicit Choices(std::function<bool(uint8_t*)> next) : next_(std::move(next)) {}
  bool exhausted() const { return exhausted_; }
  /// The next byte; 0 once exhausted.
  uint8_t Byte();
  /// A number in [0, n) (n >= 1).
  uint64_t Below(uint64_t n);
  /// True one time in n.
  bool OneIn(uint64_t n) { return Below(n) == 0; }
  /// A size from the whole int64 range: mostly 0 to `small`, else an extreme (0, ±1, INT64_MIN,
  /// INT64_MAX, 2^62 - 3, ...), a power of two, or any 64 bits.
  int64_t Size(int64_t small);

 private:
  std::function<bool(uint8_t*)> next_;
  bool exhausted_ = false;
};

/// What the runs covered, summed over runs (so a test can insist the checks were not vacuous).
struct KvCheckStats {
  int64_t operations = 0;
  int64_t steps_applied = 0, steps_not_applied = 0, step_answers_checked = 0;
  int64_t memories_computed = 0, memory_answers_checked = 0;
  int64_t decoder_answers_checked = 0;  // Of those checked, the decoder layer's (model "c").
  int64_t kept_answers_checked = 0;     // Of those checked, computed in kept runs.
  int64_t forks = 0, truncations = 0;   // Made.
  int64_t evicted = 0, expired = 0, released = 0, unloaded = 0;
  int64_t invalid = 0, not_found = 0, exhausted = 0, aborted = 0;  // Refusals seen.
  std::string ToString() const;
};

struct KvCheckOptions {
  int max_ops = 200;              ///< Operations at most (the choices may run out first).
  bool check_outputs = true;      ///< Compare computed answers with their one-call forms.
  std::string* log = nullptr;     ///< When set, receives one line per operation.
  KvCheckStats* stats = nullptr;  ///< When set, counts what the run covered.
  /// When set, steps and memories compute split across its threads (as a lone request's do).
  const Parallel* parallel = nullptr;
  /// Models whose sessions keep their keys and values in a pool and whose batched steps attend in
  /// kept runs (EngineOptions::Varlen::kEmulate).
  bool kept_runs = false;
};

/// Runs operations until the choices run out or max_ops: "" when every check held, else what broke
/// and the operations that led there. Not thread-safe (each call has a store of its own; the engine
/// models are shared and thread-safe).
std::string RunKvModelCheck(Choices& choices, const KvCheckOptions& options);

}  // namespace attnserve::testing
