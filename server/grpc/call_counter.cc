#include "server/grpc/call_counter.h"

#include <algorithm>
#include <cstring>

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace attnserve {
namespace {

// gRPC makes a marker on one thread and deletes it on another, ordered by its own synchronization,
// which ThreadSanitizer cannot see (Debian's gRPC is not built with it): the marker tells it that
// its making happens before its deletion. Nothing in other builds.
void MadeHere([[maybe_unused]] void* object) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(object);
#endif
}
void DeletedHere([[maybe_unused]] void* object) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(object);
#endif
}

}  // namespace

void CallCounter::Begin() {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  ++open_;
  last_begin_ = now;
}

void CallCounter::End(bool cancelled) {
  std::lock_guard<std::mutex> lock(mu_);
  --open_;
  if (cutting_ && cancelled) ++cut_ended_;
  if (open_ == 0) none_.notify_all();
}

int64_t CallCounter::open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_;
}

bool CallCounter::WaitNone(std::chrono::steady_clock::time_point deadline,
                           std::chrono::steady_clock::duration quiet) const {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!none_.wait_until(lock, deadline, [this] { return open_ == 0; })) return false;
    const auto quiet_until = last_begin_ + quiet;
    const auto now = std::chrono::steady_clock::now();
    if (now >= quiet_until) return true;
    if (now >= deadline) return false;
    // A call began within the quiet period: look again once it is over (or a call ends).
    none_.wait_until(lock, std::min(deadline, quiet_until));
  }
}

void CallCounter::BeginCut() {
  std::lock_guard<std::mutex> lock(mu_);
  cutting_ = true;
}

int64_t CallCounter::cut() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cut_ended_ + open_;
}

// Counts one health Check while it lives (made when gRPC matches the call to its method, destroyed
// with the call); passes every step on.
class CallCounter::Marker final : public grpc::experimental::Interceptor {
 public:
  explicit Marker(CallCounter& counter) : counter_(counter) {
    counter_.Begin();
    MadeHere(this);
  }
  ~Marker() override {
    DeletedHere(this);
    counter_.End(/*cancelled=*/false);  // Answered at once: never one the stop waits to cut.
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  CallCounter& counter_;
};

class CallCounter::Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(CallCounter& counter) : counter_(counter) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const char* method = info->method();
    const bool check =
        method != nullptr && std::strcmp(method, "/grpc.health.v1.Health/Check") == 0;
    return check ? new Marker(counter_) : nullptr;
  }

 private:
  CallCounter& counter_;
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallCounter::HealthChecks() {
  return std::make_unique<Factory>(*this);
}

}  // namespace attnserve
