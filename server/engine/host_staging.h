#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace attnserve {

/// Host memory that bytes pass through on their way to and from a CUDA device: page-locked
/// (pinned), so that a copy runs at the bus's speed, asynchronously, on the copying thread's
/// stream. A batch's inputs are gathered into one block and copied to the device in one copy; its
/// answers are copied back into one block and sent from there. Bounded: blocks held at once never
/// exceed the budget (server flag --staging-bytes, counted in the memory plan); a block that would
/// go past it is refused, and the caller copies through pageable memory instead (slower, never an
/// error). Thread-safe.
class HostStaging {
 public:
  /// `budget_bytes` 0: every Allocate is refused. `pinned` false: plain host memory, for the CPU's
  /// tests of the accounting (pinned memory needs a CUDA LibTorch and a GPU).
  HostStaging(int64_t budget_bytes, bool pinned);
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  /// A block of `bytes` (64-byte aligned), counted until the last shared_ptr to it goes; `*data`
  /// is its first byte. nullptr when the held bytes would pass the budget (or the allocation
  /// failed). The block may outlive the HostStaging.
  std::shared_ptr<void> Allocate(size_t bytes, char** data);

  int64_t budget_bytes() const { return budget_.load(); }
  /// A new budget (the memory plan's, once the models are loaded): blocks held stay; new ones
  /// count against it.
  void SetBudget(int64_t bytes) { budget_.store(bytes < 0 ? 0 : bytes); }
  /// Bytes in blocks alive now.
  int64_t held_bytes() const { return counts_->held.load(); }
  /// Allocations refused since start (the budget was full).
  int64_t refused() const { return counts_->refused.load(); }
  bool pinned() const { return pinned_; }

 private:
  struct Counts {
    std::atomic<int64_t> held{0}, refused{0};
  };
  std::atomic<int64_t> budget_;
  const bool pinned_;
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();  // Blocks may outlive this.
};

}  // namespace attnserve
