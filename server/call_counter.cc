#include "server/call_counter.h"

#include <cstring>

namespace attnserve {

// One per counted call: made when gRPC matches the call to its method, destroyed with the call's
// context once gRPC is done with it. It only passes every step on.
class CallCounter::Marker final : public grpc::experimental::Interceptor {
 public:
  explicit Marker(CallCounter& counter) : counter_(counter) { counter_.Add(); }
  ~Marker() override { counter_.Remove(); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  CallCounter& counter_;
};

class CallCounter::Factory_ final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory_(CallCounter& counter) : counter_(counter) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const char* method = info->method();
    if (method != nullptr && (std::strcmp(method, "/grpc.health.v1.Health/Watch") == 0 ||
                              std::strncmp(method, "/grpc.reflection.", 17) == 0)) {
      return nullptr;
    }
    return new Marker(counter_);
  }

 private:
  CallCounter& counter_;
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallCounter::Factory() {
  return std::make_unique<Factory_>(*this);
}

void CallCounter::Add() { open_.fetch_add(1, std::memory_order_relaxed); }

void CallCounter::Remove() {
  if (open_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // Under the lock: a waiter is either before its check or asleep, never between the two.
    std::lock_guard<std::mutex> lock(mu_);
    none_cv_.notify_all();
  }
}

int64_t CallCounter::open() const { return open_.load(std::memory_order_acquire); }

bool CallCounter::WaitNone(std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  return none_cv_.wait_until(lock, deadline, [this] { return open() == 0; });
}

}  // namespace attnserve
