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
  served_ = known_;
  for (auto* health : services_) {
    health->SetServingStatus(false);
    health->SetServingStatus(kServiceName, false);
    health->SetServingStatus(kRepositoryName, false);
    for (const std::string& name : known_) health->SetServingStatus(ModelName(name), false);
  }
}

void HealthReporter::Ready() {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_) return;
  ready_ = true;
  Apply();
}

void HealthReporter::Apply() {
  for (auto* health : services_) {
    health->SetServingStatus(accepting_);
    health->SetServingStatus(kServiceName, accepting_);
    health->SetServingStatus(kRepositoryName, accepting_ && repository_ok_);
    for (const std::string& name : known_)
      health->SetServingStatus(ModelName(name), accepting_ && served_.count(name) > 0);
  }
}

void HealthReporter::SetAccepting(bool accepting) {
  std::lock_guard<std::mutex> lock(mu_);
  if (accepting_ == accepting) return;
  accepting_ = accepting;
  if (ready_ && !shut_) Apply();
}

void HealthReporter::OnReloaded(const ReloadReport& report, const ModelSet& set,
                                const std::map<std::string, std::string>& failing) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, why] : failing) known_.insert(name);
  served_.clear();
  for (const auto& [name, versions] : set.models) served_.insert(name);
  known_.insert(served_.begin(), served_.end());
  repository_ok_ = report.status.ok() && failing.empty();
  if (ready_ && !shut_) Apply();  // Before Ready, Ready applies them.
}

void HealthReporter::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shut_ = true;
  for (auto* health : services_) health->Shutdown();
}

}  // namespace attnserve
