#pragma once

#include <chrono>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <string>

#include "server/core/status.h"

namespace attnserve {

/// Triton's sequence parameters on a request: a client-chosen correlation id and the flags that
/// start and end the sequence.
struct OipSequence {
  std::string
      id;  ///< The id as text, with its kind ("i:7", "s:abc"): ids of different kinds differ.
  bool start = false;
  bool end = false;
  /// Who sends it: ids are kept per tenant too, so two tenants' equal ids never meet.
  std::string tenant = "default";
};

/// Triton's sequences onto attnserve's decoding sessions: a start opens a session (the caller's
/// `open`), each step of the sequence steps that session, and the end (or a new start with the same
/// id) closes it (the caller's `close`). Ids are the clients' and are kept per model. Bounded: at
/// most `max_sequences` at once (a start beyond gets RESOURCE_EXHAUSTED), and a sequence unused for
/// `idle` (the sessions' TTL, after which the store has ended its session) is forgotten when room
/// is needed. Gets no gRPC and no engine: tests drive it with their own clock. Thread-safe.
class OipSequences {
 public:
  using Clock = std::chrono::steady_clock;
  OipSequences(
      size_t max_sequences, Clock::duration idle,
      std::function<Clock::time_point()> clock = [] { return Clock::now(); });

  /// The session handle the request steps: at a start, a new one from `open` (closing the one the
  /// id held, if any, with `close`); otherwise the one the id holds, or NOT_FOUND naming the id.
  StatusOr<std::string> Begin(const std::string& model, const OipSequence& seq,
                              const std::function<StatusOr<std::string>()>& open,
                              const std::function<void(const std::string&)>& close);
  /// After the step: at the end, or when a start's step failed, or when the session is gone
  /// (`result` NOT_FOUND: expired or closed elsewhere), the sequence is forgotten (its session
  /// closed with `close` unless it is gone).
  void Finish(const std::string& model, const OipSequence& seq, const std::string& handle,
              const Status& result, const std::function<void(const std::string&)>& close);

  size_t size() const;

 private:
  struct Entry {
    std::string handle;
    Clock::time_point used;
    std::list<std::string>::iterator lru;
  };
  static std::string Key(const std::string& model, const OipSequence& seq) {
    return seq.tenant + '\n' + model + '\n' + seq.id;
  }
  // With mu_ held: forgets sequences idle since before `now - idle_`, oldest first.
  void ForgetIdle(Clock::time_point now);

  const size_t max_;
  const Clock::duration idle_;
  const std::function<Clock::time_point()> clock_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
  std::list<std::string> lru_;  // Keys, least recently used first.
};

}  // namespace attnserve
