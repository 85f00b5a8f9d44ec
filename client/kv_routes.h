#pragma once
// Where a memory's or session's calls go (docs/kv.md "Sessions across replicas"): the route each
// handle this client made was given, so that its calls reach the replica holding it. Not public
// API: client.cc's only.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

namespace attnserve {

/// A memory's or session's way back to its replica: the address its server advertised
/// (KvHandle.replica; "" when none), sent as the `attnserve-replica` metadata with each of its
/// calls (deploy/nginx routes by it) or, with ClientOptions::route_to_replica, called straight.
struct KvRoute {
  std::string replica;
  /// The model the handle is on (KvHandle.model, model_version): its wire dtype.
  std::string model;
  int64_t model_version = 0;
};

/// The routes of the handles a client made, bounded: beyond `capacity` the oldest are forgotten
/// (their calls then go through the client's target, unrouted). Thread-safe.
class KvRoutes {
 public:
  static constexpr const char* kMetadataKey = "attnserve-replica";
  explicit KvRoutes(size_t capacity = size_t{1} << 18) : capacity_(capacity) {}

  void Remember(const std::string& handle, KvRoute route);
  /// The route of `handle`; replica "" when this client did not make it (or forgot it).
  KvRoute Find(const std::string& handle) const;
  void Forget(const std::string& handle);
  size_t size() const;

 private:
  const size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, KvRoute> routes_;
  std::deque<std::string> order_;  // Oldest first; may name handles already forgotten.
};

}  // namespace attnserve
