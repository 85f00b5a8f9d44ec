#include "server/engine/host_staging.h"

#include <cstdlib>

#include "server/engine/device_support.h"

namespace attnserve {

HostStaging::HostStaging(int64_t budget_bytes, bool pinned)
    : budget_(budget_bytes < 0 ? 0 : budget_bytes), pinned_(pinned) {}

HostStaging::~HostStaging() = default;

std::shared_ptr<void> HostStaging::Allocate(size_t bytes, char** data) {
  *data = nullptr;
  const int64_t n = static_cast<int64_t>((bytes + 63) / 64 * 64);
  const int64_t budget = budget_.load();
  if (n <= 0 || n > budget) {
    if (n > 0) counts_->refused.fetch_add(1);
    return nullptr;
  }
  int64_t held = counts_->held.load();
  do {
    if (held + n > budget) {
      counts_->refused.fetch_add(1);
      return nullptr;
    }
  } while (!counts_->held.compare_exchange_weak(held, held + n));
  std::shared_ptr<Counts> counts = counts_;
  const auto give_back = [counts, n] { counts->held.fetch_sub(n); };
  if (pinned_) {
    std::shared_ptr<void> block = AllocatePinned(static_cast<size_t>(n), data);
    if (!block) {
      give_back();
      return nullptr;
    }
    return std::shared_ptr<void>(block.get(), [block, give_back](void*) mutable {
      block.reset();
      give_back();
    });
  }
  void* p = std::aligned_alloc(64, static_cast<size_t>(n));
  if (p == nullptr) {
    give_back();
    return nullptr;
  }
  *data = static_cast<char*>(p);
  return std::shared_ptr<void>(p, [give_back](void* q) {
    std::free(q);
    give_back();
  });
}

}  // namespace attnserve
