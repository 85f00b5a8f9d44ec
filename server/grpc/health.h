#pragma once

#include <grpcpp/health_check_service_interface.h>

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "server/models/model_repository.h"

namespace attnserve {

/// What grpc.health.v1 says, on every listener that serves it (--address, --health-address):
///   every name                                NOT_SERVING while the models warm up at start;
///   ""  and "attnserve.v1.AttentionService"  SERVING once warm, until the drain begins;
///   "attnserve.v1.ModelRepository"            NOT_SERVING while the latest load of some model
///   failed
///                                             (what served before still serves);
///   "attnserve.v1.AttentionService/<model>"   SERVING while the model is loaded, NOT_SERVING once
///                                             a reload removed it (or its first load failed);
///   every name                                NOT_SERVING while the gRPC listener accepts no
///                                             connection (SetAccepting).
/// Thread-safe.
class HealthReporter {
 public:
  /// Reports everything NOT_SERVING on each of `services` (gRPC's default health services) until
  /// Ready: the models are warming up.
  HealthReporter(std::vector<grpc::HealthCheckServiceInterface*> services, const ModelSet& models);

  /// The models are warm: `models` and the server SERVING (unless the drain began meanwhile).
  void Ready();

  /// After a reload: the repository's status and every model's that health has ever named.
  void OnReloaded(const ReloadReport& report, const ModelSet& set,
                  const std::map<std::string, std::string>& failing);
  /// NOT_SERVING for everything, from now on (the drain began).
  void Shutdown();
  /// Whether the gRPC listener takes connections: while it does not, every name is NOT_SERVING
  /// (what a --health-address listener, which still answers, then says).
  void SetAccepting(bool accepting);

 private:
  std::mutex mu_;
  const std::vector<grpc::HealthCheckServiceInterface*> services_;
  std::set<std::string> known_;   // Every model name health has reported on.
  std::set<std::string> served_;  // The model names loaded now.
  bool repository_ok_ = true;     // The latest reload failed nowhere.
  bool ready_ = false;            // Warm: what health says follows the models.
  bool shut_ = false;             // The drain began: NOT_SERVING for good.
  bool accepting_ = true;         // The gRPC listener takes connections.
  void Apply();                   // Under mu_, once ready: the statuses above.
};

}  // namespace attnserve
