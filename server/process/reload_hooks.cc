#include "server/process/reload_hooks.h"

namespace attnserve {

ModelRepositoryHooks ReloadHooks(ServerMetrics& metrics, KvStore& kv, HealthReporter& health) {
  ModelRepositoryHooks hooks;
  // New weights for a version leave its memories and sessions on the weights they were made with
  // (their entries hold them; attnserve_kv_model_entries counts them); new ones get the new
  // weights. A version removed ends its entries.
  hooks.on_loaded = [&metrics](const ModelSpec& loaded, const ModelSpec* replaced) {
    if (replaced) metrics.RemoveModelInfo(*replaced);
    metrics.AddModelInfo(loaded);
  };
  hooks.on_unloaded = [&metrics, &kv](const ModelSpec& removed) {
    metrics.RemoveModelInfo(removed);
    kv.EndModel(removed);
  };
  hooks.on_reloaded = [&metrics, &health](const ReloadReport& report, const ModelSet& set,
                                          const std::map<std::string, std::string>& failing) {
    std::vector<std::string> failed_now;
    for (const RepositoryChange& c : report.changes) {
      if (c.action == RepositoryChange::Action::kFailed &&
          (failed_now.empty() || failed_now.back() != c.name)) {
        failed_now.push_back(c.name);
      }
    }
    metrics.RecordReload(report.failed(), failed_now);
    std::vector<std::string> failing_names;
    for (const auto& [name, why] : failing) failing_names.push_back(name);
    metrics.SetModelsFailing(failing_names);
    health.OnReloaded(report, set, failing);
  };
  return hooks;
}

}  // namespace attnserve
