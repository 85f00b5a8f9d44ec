#include "server/pipeline/fair_share.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace attnserve {

double FairShare::Lift() const {
  double lowest = std::numeric_limits<double>::infinity();
  for (const auto& [name, t] : tenants_) {
    if (t.queued > 0) lowest = std::min(lowest, t.counter);
  }
  return lowest == std::numeric_limits<double>::infinity() ? floor_ : lowest;
}

void FairShare::Arrive(const std::string& tenant) {
  auto it = tenants_.find(tenant);
  if (it == tenants_.end() || it->second.queued == 0) {
    const double lift = Lift();
    Tenant& t = tenants_[tenant];
    t.counter = std::max(t.counter, lift);
    ++t.queued;
    return;
  }
  ++it->second.queued;
}

void FairShare::Leave(const std::string& tenant) {
  auto it = tenants_.find(tenant);
  if (it == tenants_.end() || it->second.queued == 0) return;
  if (--it->second.queued == 0 && tenants_.size() > kRemembered) Forget();
}

void FairShare::Charge(const std::string& tenant, double flops, double weight) {
  Tenant& t = tenants_[tenant];
  t.counter += flops / (weight > 0 ? weight : 1);
  floor_ = t.counter;
}

double FairShare::Counter(const std::string& tenant) const {
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second.counter;
}

int64_t FairShare::Queued(const std::string& tenant) const {
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second.queued;
}

void FairShare::Forget() {
  // An idle tenant at or below the lift comes back lifted to it: forgetting it changes nothing.
  const double lift = Lift();
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    it = it->second.queued == 0 && it->second.counter <= lift ? tenants_.erase(it) : std::next(it);
  }
  if (tenants_.size() <= kRemembered) return;
  // Still too many idle tenants above it: the lowest of them lose their excess (they would be
  // lifted to the smallest waiting counter on return), so memory stays bounded.
  std::vector<std::pair<double, std::string>> idle;
  for (const auto& [name, t] : tenants_) {
    if (t.queued == 0) idle.emplace_back(t.counter, name);
  }
  std::sort(idle.begin(), idle.end());
  for (size_t i = 0; i < idle.size() && tenants_.size() > kRemembered; ++i) {
    tenants_.erase(idle[i].second);
  }
}

}  // namespace attnserve
