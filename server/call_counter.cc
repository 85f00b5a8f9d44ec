#include "server/call_counter.h"

#include <grpc/grpc.h>
#include <grpc/support/alloc.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

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

// gRPC's channelz answer for `text` (freed here), or null JSON.
nlohmann::json Channelz(char* text) {
  if (text == nullptr) return nullptr;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  gpr_free(text);
  return j.is_discarded() ? nlohmann::json() : j;
}

// A channelz int64 (a string; absent when 0).
int64_t Count(const nlohmann::json& data, const char* key) {
  const auto it = data.find(key);
  if (it == data.end()) return 0;
  if (it->is_string()) return std::strtoll(it->get<std::string>().c_str(), nullptr, 10);
  return it->is_number() ? it->get<int64_t>() : 0;
}

// The channelz ids of every server in the process (pages of up to 100).
std::vector<intptr_t> ServerIds() {
  std::vector<intptr_t> ids;
  intptr_t start = 0;
  for (;;) {
    const nlohmann::json page = Channelz(grpc_channelz_get_servers(start));
    if (!page.is_object()) return ids;
    const auto servers = page.find("server");
    if (servers == page.end() || !servers->is_array() || servers->empty()) return ids;
    for (const auto& s : *servers) {
      const intptr_t id = Count(s.value("ref", nlohmann::json::object()), "serverId");
      ids.push_back(id);
      start = std::max(start, id + 1);
    }
    if (page.value("end", true)) return ids;
  }
}

}  // namespace

// Marks one long-lived call while it lives (made when gRPC matches the call to its method,
// destroyed with the call); passes every step on.
class CallCounter::Marker final : public grpc::experimental::Interceptor {
 public:
  explicit Marker(CallCounter& counter) : counter_(counter) {
    ++counter_.long_lived_;
    MadeHere(this);
  }
  ~Marker() override {
    DeletedHere(this);
    --counter_.long_lived_;
  }
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
    const bool long_lived =
        method != nullptr && (std::strcmp(method, "/grpc.health.v1.Health/Watch") == 0 ||
                              std::strncmp(method, "/grpc.reflection.", 17) == 0);
    return long_lived ? new Marker(counter_) : nullptr;
  }

 private:
  CallCounter& counter_;
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallCounter::Factory() {
  return std::make_unique<Factory_>(*this);
}

void CallCounter::BeforeBuild() {
  for (intptr_t id : ServerIds()) last_id_before_ = std::max(last_id_before_, id);
}

bool CallCounter::Attach() {
  intptr_t found = 0;
  for (intptr_t id : ServerIds()) {
    if (id > last_id_before_ && (found == 0 || id < found)) found = id;
  }
  server_id_ = found;
  return found != 0;
}

int64_t CallCounter::open() const {
  if (server_id_ == 0) return -1;
  const nlohmann::json server = Channelz(grpc_channelz_get_server(server_id_));
  if (!server.is_object() || !server.contains("server")) return 0;  // Gone: nothing held.
  const nlohmann::json data = server["server"].value("data", nlohmann::json::object());
  const int64_t held = Count(data, "callsStarted") - Count(data, "callsSucceeded") -
                       Count(data, "callsFailed") - long_lived_.load();
  return std::max<int64_t>(held, 0);
}

bool CallCounter::WaitNone(std::chrono::steady_clock::time_point deadline) const {
  for (;;) {
    const int64_t n = open();
    if (n == 0) return true;
    if (n < 0 || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace attnserve
