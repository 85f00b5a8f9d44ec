#include "server/grpc/health.h"

namespace attnserve {
namespace {

constexpr char kServiceName[] = "attnserve.v1.AttentionService";
constexpr char kRepositoryName[] = "attnserve.v1.ModelRepository";

std::string ModelName(const std::string& model) { return std::string(kServiceName) + "/" + model; }

}  // namespace

HealthReporter::HealthReporter(std::vector<grpc::HealthCheckServiceInterface*> services,
                               const ModelSet& models)
    : services_(std::move(services)) {
  for (const auto& [name, versions] : models.models) known_.insert(name);
  for (auto* health : services_) {
    health->SetServingStatus(true);
    health->SetServingStatus(kServiceName, true);
    health->SetServingStatus(kRepositoryName, true);
    for (const std::string& name : known_) health->SetServingStatus(ModelName(name), true);
  }
}

void HealthReporter::OnReloaded(const ReloadReport& report, const ModelSet& set,
                                const std::map<std::string, std::string>& failing) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, why] : failing) known_.insert(name);
  for (const auto& [name, versions] : set.models) known_.insert(name);
  for (auto* health : services_) {
    health->SetServingStatus(kRepositoryName, report.status.ok() && failing.empty());
    for (const std::string& name : known_)
      health->SetServingStatus(ModelName(name), set.models.count(name) > 0);
  }
}

void HealthReporter::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto* health : services_) health->Shutdown();
}

}  // namespace attnserve
