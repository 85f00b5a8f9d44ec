#include "server/protocol/oip_sequences.h"

#include <utility>

namespace attnserve {

OipSequences::OipSequences(size_t max_sequences, Clock::duration idle,
                           std::function<Clock::time_point()> clock)
    : max_(max_sequences), idle_(idle), clock_(std::move(clock)) {}

size_t OipSequences::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void OipSequences::ForgetIdle(Clock::time_point now) {
  while (!lru_.empty()) {
    auto it = entries_.find(lru_.front());
    if (now - it->second.used < idle_) return;
    // Its session has expired in the store by now: nothing to close.
    entries_.erase(it);
    lru_.pop_front();
  }
}

StatusOr<std::string> OipSequences::Begin(const std::string& model, const OipSequence& seq,
                                          const std::function<StatusOr<std::string>()>& open,
                                          const std::function<void(const std::string&)>& close) {
  const std::string key = Key(model, seq);
  const auto now = clock_();
  std::lock_guard<std::mutex> lock(mu_);
  ForgetIdle(now);
  auto it = entries_.find(key);
  if (!seq.start) {
    if (it == entries_.end()) {
      return NotFound("parameters['sequence_id']: " + seq.id.substr(2) + " of model '" + model +
                      "' is not in progress (it ended, expired after its session's TTL, or never "
                      "started); start it with sequence_start");
    }
    it->second.used = now;
    lru_.splice(lru_.end(), lru_, it->second.lru);
    return it->second.handle;
  }
  if (it != entries_.end()) {  // A new start for an id in progress: the old sequence ends.
    close(it->second.handle);
    lru_.erase(it->second.lru);
    entries_.erase(it);
  }
  if (entries_.size() >= max_) {
    return Status(
        StatusCode::kResourceExhausted,
        "parameters['sequence_start']: " + std::to_string(entries_.size()) +
            " sequences are in progress, the most the server keeps (server flag --kv-max-entries); "
            "end some with sequence_end");
  }
  ASSIGN_OR_RETURN(std::string handle, open());
  lru_.push_back(key);
  entries_[key] = Entry{handle, now, std::prev(lru_.end())};
  return handle;
}

void OipSequences::Finish(const std::string& model, const OipSequence& seq,
                          const std::string& handle, const Status& result,
                          const std::function<void(const std::string&)>& close) {
  const bool gone = result.code() == StatusCode::kNotFound;
  if (!seq.end && !gone && !(seq.start && !result.ok())) return;
  std::string to_close;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(Key(model, seq));
    if (it == entries_.end() || it->second.handle != handle)
      return;  // Already replaced or forgotten.
    if (!gone) to_close = it->second.handle;
    lru_.erase(it->second.lru);
    entries_.erase(it);
  }
  if (!to_close.empty()) close(to_close);
}

}  // namespace attnserve
