#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/engine/attention_model.h"
#include "server/metrics.h"
#include "server/batcher.h"

namespace attnserve {

/// Loaded models by name.
using ModelMap = std::map<std::string, std::unique_ptr<AttentionModel>>;

/// The gRPC AttentionService on the callback API. Handlers only translate: the request path is
/// model lookup -> FromWire -> Validate -> Batcher -> engine -> response. Thread-safe.
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  /// Borrows everything; all must outlive the service.
  AttentionServiceImpl(const ModelMap& models, Batcher& batcher, ServerMetrics& metrics,
                       const AttendLimits& limits);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx, const v1::AttendRequest* req,
                                   v1::AttendResponse* resp) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttendStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* req,
                                       v1::ListModelsResponse* resp) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* ctx,
                                     const v1::GetModelRequest* req, v1::ModelInfo* resp) override;

  /// The shared request path for one AttendRequest. `request` and `response` must live until
  /// `done` has run; `done` runs exactly once, on any thread, after the response is complete.
  /// Records the request's metrics under `method`.
  void Dispatch(const char* method, const v1::AttendRequest& request,
                v1::AttendResponse* response, SteadyClock::time_point deadline,
                std::function<bool()> cancelled, std::function<void(const Status&)> done);

 private:
  class StreamReactor;

  const ModelMap& models_;
  Batcher& batcher_;
  ServerMetrics& metrics_;
  const AttendLimits limits_;
};

}  // namespace attnserve
