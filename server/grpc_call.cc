#include "server/grpc_call.h"

#include <cstdlib>
#include <string>

#include "server/grpc_status.h"

namespace attnserve {

CallContext CallOf(grpc::CallbackServerContext* ctx) {
  CallContext call;
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    call.deadline = SteadyClock::now() + (deadline - std::chrono::system_clock::now());
  }
  call.cancelled = [ctx] { return ctx->IsCancelled(); };
  const auto& metadata = ctx->client_metadata();
  if (auto it = metadata.find("grpc-previous-rpc-attempts"); it != metadata.end()) {
    const std::string text(it->second.data(), it->second.size());
    call.previous_attempts = static_cast<uint32_t>(std::strtoul(text.c_str(), nullptr, 10));
  }
  return call;
}

grpc::ServerUnaryReactor* Finished(grpc::CallbackServerContext* ctx, const Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace attnserve
