#pragma once
// Splitting one batch's compute across cores that are idle at the moment (a lone request gets the
// whole machine, a busy machine gets full batches). The engine cuts its work into pieces
// (projection rows, query blocks, requests) and hands them to a Parallel; who runs the pieces is
// the caller's business: the batcher lends its idle compute threads, a benchmark or test its own
// pool. Every piece runs single-threaded LibTorch and BLAS on one thread, so answers are what they
// are serially, up to float rounding.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attnserve {

/// Runs the pieces of one computation on the calling thread and on threads that are idle.
/// Thread-safe.
class Parallel {
 public:
  virtual ~Parallel() = default;
  /// Threads that may run pieces at once right now, the caller included (>= 1). Cut the work into
  /// about this many pieces; 1 means run it as one.
  virtual int Width() const = 0;
  /// Calls fn(i) for every i in [0, n) and returns once all have returned: the caller runs pieces
  /// itself and idle threads join in, each piece on one thread. `fn` must not throw.
  virtual void For(int64_t n, const std::function<void(int64_t)>& fn) const = 0;
};

/// One thread: Width() 1, For runs the pieces in order on the caller.
const Parallel& SerialParallel();

/// Offers pieces to helper threads. For() publishes a job, runs pieces on the caller, and waits
/// for the pieces helpers took; helpers call Help() when they have nothing else to do. Width()
/// comes from `width` (how many threads are idle now, plus one). Thread-safe.
class PieceExchange final : public Parallel {
 public:
  /// `width`: the current width (called often: keep it cheap). `wake`: called after a job is
  /// published, to wake idle helpers (it must make a helper that is about to wait see HasWork()).
  PieceExchange(std::function<int()> width, std::function<void()> wake);
  int Width() const override { return width_(); }
  void For(int64_t n, const std::function<void(int64_t)>& fn) const override;
  /// True when some published job has pieces left.
  bool HasWork() const;
  /// Runs pieces of published jobs until none is left; false when there were none.
  bool Help() const;

 private:
  struct Job;
  static void RunPieces(Job* job);
  const std::function<int()> width_;
  const std::function<void()> wake_;
  mutable std::mutex mu_;
  mutable std::condition_variable helpers_done_;
  mutable std::vector<Job*> jobs_;
};

/// `threads` helper threads of its own, waiting for pieces (benchmarks and tests: the in-process
/// engine with the parallelism the server gives a lone request). Width() is threads + 1.
class HelperPool final : public Parallel {
 public:
  explicit HelperPool(int threads);
  ~HelperPool() override;
  HelperPool(const HelperPool&) = delete;
  HelperPool& operator=(const HelperPool&) = delete;
  int Width() const override { return exchange_.Width(); }
  void For(int64_t n, const std::function<void(int64_t)>& fn) const override {
    exchange_.For(n, fn);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  const int threads_;
  PieceExchange exchange_;
  std::vector<std::thread> helpers_;
};

}  // namespace attnserve
