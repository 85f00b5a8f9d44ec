#pragma once
// Fair shares between tenants: the Virtual Token Counter ("Fairness in Serving LLMs", OSDI 2024),
// counted in the FLOPs a request computes rather than in tokens. No threads, no clocks.

#include <cstdint>
#include <string>
#include <unordered_map>

namespace attnserve {

/// Each tenant's counter of the work it was served, divided by its weight, and how many of its
/// requests wait. The backlogged tenant with the smallest counter goes next. A tenant that
/// arrives with nothing queued has its counter lifted to the smallest among the tenants waiting
/// (to the last one served when none waits): idle time earns no credit. Not thread-safe (the
/// batcher holds it under its lock).
class FairShare {
 public:
  /// A request of `tenant` joins a queue.
  void Arrive(const std::string& tenant);
  /// A request of `tenant` left the queues (taken into a batch, dropped or refused after Arrive).
  void Leave(const std::string& tenant);
  /// `tenant` was served `flops` of work at `weight` (> 0).
  void Charge(const std::string& tenant, double flops, double weight);
  /// The tenant's counter (0 for one never seen or forgotten).
  double Counter(const std::string& tenant) const;
  /// Its requests waiting in any queue.
  int64_t Queued(const std::string& tenant) const;
  /// Tenants remembered (backlogged, or idle with a counter above the floor): bounded by
  /// kRemembered beyond the backlogged ones.
  size_t size() const { return tenants_.size(); }
  static constexpr size_t kRemembered = 4096;

 private:
  struct Tenant {
    double counter = 0;
    int64_t queued = 0;
  };
  // The smallest counter among backlogged tenants; `floor_` when none is.
  double Lift() const;
  // Forgets idle tenants that a return would lift anyway, then the lowest idle ones.
  void Forget();

  std::unordered_map<std::string, Tenant> tenants_;
  double floor_ = 0;  // The last charged tenant's counter after the charge.
};

}  // namespace attnserve
