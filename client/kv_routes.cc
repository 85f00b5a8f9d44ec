#include "kv_routes.h"

#include <utility>

namespace attnserve {

void KvRoutes::Remember(const std::string& handle, KvRoute route) {
  std::lock_guard<std::mutex> lock(mu_);
  if (routes_.insert_or_assign(handle, std::move(route)).second) order_.push_back(handle);
  while (routes_.size() > capacity_ && !order_.empty()) {
    routes_.erase(order_.front());
    order_.pop_front();
  }
  // Forgotten handles leave stale names in order_: drop them once they are most of it.
  if (order_.size() > 2 * routes_.size() + 64) {
    std::deque<std::string> live;
    for (std::string& h : order_)
      if (routes_.count(h) != 0) live.push_back(std::move(h));
    order_.swap(live);
  }
}

KvRoute KvRoutes::Find(const std::string& handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = routes_.find(handle);
  return it == routes_.end() ? KvRoute{} : it->second;
}

void KvRoutes::Forget(const std::string& handle) {
  std::lock_guard<std::mutex> lock(mu_);
  routes_.erase(handle);
}

size_t KvRoutes::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return routes_.size();
}

}  // namespace attnserve
