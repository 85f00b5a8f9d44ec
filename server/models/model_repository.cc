#include "server/models/model_repository.h"

#include <algorithm>
#include <iostream>
#include <new>
#include <set>

#include "server/models/model_loader.h"

namespace attnserve {
namespace {

using Key = std::pair<std::string, int64_t>;

Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

// Same served behaviour: the same weights, heads and options from the same file.
bool SameModel(const ModelSpec& a, const ModelSpec& b) {
  return a.weights_hash == b.weights_hash && a.num_heads == b.num_heads &&
         a.add_zero_attn == b.add_zero_attn && a.source == b.source;
}

// A load that ran out of memory (a model's files claiming more than the process can hold, a
// sparse 16 GiB file among them): RESOURCE_EXHAUSTED naming `what`, instead of a throw that ends
// the process (reloads run beside the versions serving).
Status OutOfMemoryLoading(const std::string& what) {
  return Status(StatusCode::kResourceExhausted,
                what +
                    ": out of memory loading its weights (a load holds up to ~4.5x their bytes "
                    "at once); not served");
}

// A version loaded and warmed: it serves fast from its first request.
StatusOr<std::shared_ptr<const AttentionModel>> Build(const ModelSource& source,
                                                      const EngineOptions& engine,
                                                      const WarmupShapes& warmup,
                                                      const WarmRunner& run) {
  try {
    ASSIGN_OR_RETURN(ModelWeights w, LoadModel(source.dir, source.name, source.version));
    ASSIGN_OR_RETURN(std::unique_ptr<AttentionModel> made, CreateTorchModel(w, engine));
    std::shared_ptr<const AttentionModel> model = std::move(made);
    const Status warm = WarmModel(model, warmup, run);
    if (!warm.ok())
      return Status(StatusCode::kFailedPrecondition, source.dir + ": " + warm.message());
    return model;
  } catch (const std::bad_alloc&) {
    return OutOfMemoryLoading(source.dir);
  }
}

}  // namespace

std::shared_ptr<const AttentionModel> ModelSet::Find(const std::string& name,
                                                     int64_t version) const {
  auto it = models.find(name);
  if (it == models.end() || it->second.empty()) return nullptr;
  if (version == 0) return it->second.rbegin()->second;
  auto v = it->second.find(version);
  return v == it->second.end() ? nullptr : v->second;
}

StatusOr<std::shared_ptr<const AttentionModel>> ModelSet::Lookup(const std::string& name,
                                                                 int64_t version,
                                                                 const char* name_field,
                                                                 const char* version_field) const {
  if (version < 0) {
    return InvalidArgument(std::string(version_field) + ": " + std::to_string(version) +
                           "; allowed: 0 (the highest loaded) or a loaded version");
  }
  if (std::shared_ptr<const AttentionModel> model = Find(name, version)) return model;
  auto it = models.find(name);
  if (it == models.end()) {
    return NotFound(std::string(name_field) + ": '" + name +
                    "' is not loaded; available: " + Names());
  }
  std::string versions;
  for (const auto& [v, m] : it->second)
    versions += (versions.empty() ? "" : ", ") + std::to_string(v);
  return NotFound(std::string(version_field) + ": " + std::to_string(version) + " of '" + name +
                  "' is not loaded; loaded versions: " + versions);
}

std::string ModelSet::Names() const {
  std::string names;
  for (const auto& [name, versions] : models) names += (names.empty() ? "" : ", ") + name;
  return names;
}

size_t ModelSet::versions() const {
  size_t n = 0;
  for (const auto& [name, versions] : models) n += versions.size();
  return n;
}

bool ReloadReport::failed() const {
  if (!status.ok()) return true;
  for (const RepositoryChange& c : changes) {
    if (c.action == RepositoryChange::Action::kFailed) return true;
  }
  return false;
}

ModelRepository::ModelRepository(std::string dir, EngineOptions engine, WarmupShapes warmup)
    : dir_(std::move(dir)), engine_(std::move(engine)), warmup_(warmup) {}

ModelRepository::~ModelRepository() { Stop(); }

StatusOr<std::unique_ptr<ModelRepository>> ModelRepository::Open(const std::string& dir,
                                                                 const EngineOptions& engine,
                                                                 const WarmupShapes& warmup) {
  std::unique_ptr<ModelRepository> repo(new ModelRepository(dir, engine, warmup));
  auto set = std::make_shared<ModelSet>();
  if (dir.empty()) {
    ASSIGN_OR_RETURN(auto model, CreateTorchModel(DemoModelWeights(), engine));
    set->models["demo"][1] = std::move(model);
  } else {
    // Start-up is all or nothing: a server that starts serves every model it was given.
    try {
      RepositoryScan scan;
      ASSIGN_OR_RETURN(std::vector<ModelWeights> weights, LoadModelDirectory(dir, &scan));
      for (size_t i = 0; i < weights.size(); ++i) {
        const ModelSource& source = scan.sources[i];
        ASSIGN_OR_RETURN(auto model, CreateTorchModel(weights[i], engine));
        set->models[source.name][source.version] = std::move(model);
        repo->fingerprints_[{source.name, source.version}] = source.fingerprint;
      }
    } catch (const std::bad_alloc&) {
      return OutOfMemoryLoading("--models " + dir);
    }
    repo->thread_ = std::thread([r = repo.get()] { r->Loop(); });
  }
  repo->set_ = std::move(set);
  return repo;
}

Status ModelRepository::Warm() {
  WarmRunner run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    run = warm_runner_;
  }
  for (const auto& [name, versions] : Snapshot()->models) {
    for (const auto& [version, model] : versions) {
      const Status warm = WarmModel(model, warmup_, run);
      if (!warm.ok()) {
        return Status(StatusCode::kFailedPrecondition,
                      name + " version " + std::to_string(version) + ": " + warm.message());
      }
    }
  }
  return Status::Ok();
}

std::shared_ptr<const ModelSet> ModelRepository::Snapshot() const {
  std::lock_guard<std::mutex> lock(set_mu_);
  return set_;
}

void ModelRepository::Publish(std::shared_ptr<const ModelSet> set) {
  std::shared_ptr<const ModelSet> old;
  {
    std::lock_guard<std::mutex> lock(set_mu_);
    old = std::move(set_);
    set_ = std::move(set);
  }
  // `old` goes here, outside the lock: models only it held unload now.
}

void ModelRepository::SetWarmRunner(WarmRunner run) {
  std::lock_guard<std::mutex> lock(mu_);
  warm_runner_ = std::move(run);
}

void ModelRepository::SetHooks(ModelRepositoryHooks hooks) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_ = std::move(hooks);
}

void ModelRepository::RequestReload(std::function<void(const ReloadReport&)> done) {
  ReloadReport refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dir_.empty()) {
      refused.status = Status(StatusCode::kFailedPrecondition,
                              "reload: the server serves the built-in demo model (no --models "
                              "directory); there is nothing to reload");
    } else if (stopping_) {
      refused.status = Unavailable("reload: the server is shutting down");
    } else {
      requested_ = true;
      if (done) pending_.push_back(std::move(done));
    }
  }
  if (!refused.status.ok()) {
    if (done) done(refused);
    return;
  }
  cv_.notify_all();
}

void ModelRepository::Stop() {
  std::vector<std::function<void(const ReloadReport&)>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(pending_);
  }
  ReloadReport report;
  report.status = Unavailable("reload: the server is shutting down");
  for (auto& done : left) done(report);
}

void ModelRepository::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return requested_ || stopping_; });
    if (stopping_) return;
    requested_ = false;
    auto waiting = std::move(pending_);
    pending_.clear();
    lock.unlock();
    const ReloadReport report = Reload();
    ModelRepositoryHooks hooks;
    {
      std::lock_guard<std::mutex> hooks_lock(mu_);
      hooks = hooks_;
    }
    if (hooks.on_reloaded) {
      std::map<std::string, std::string> failing;
      for (const auto& [key, why] : failures_) failing.emplace(key.first, why);
      hooks.on_reloaded(report, *Snapshot(), failing);
    }
    const char* outcome = report.failed() ? "with failures" : "done";
    std::cerr << "attnserve: model reload " << outcome << ": " << report.models_served
              << " versions serving";
    if (!report.status.ok()) std::cerr << "; " << report.status.ToString();
    std::cerr << "\n";
    for (const RepositoryChange& c : report.changes) {
      static const char* kAction[] = {"loaded", "updated", "unloaded", "FAILED"};
      std::cerr << "attnserve:   " << c.name << " version " << c.version << ": "
                << kAction[static_cast<int>(c.action)]
                << (c.weights_hash.empty() ? "" : " " + c.weights_hash.substr(0, 19))
                << (c.message.empty() ? "" : ": " + c.message) << "\n";
    }
    for (auto& done : waiting) done(report);
    lock.lock();
  }
}

// What a scan changes against the set serving, before anything is loaded: a pure function of the
// scan, the set and the fingerprints of what serves.
struct RepositoryDiff {
  std::vector<const ModelSource*> to_load;  // New versions, and those whose files changed.
  std::vector<Key> removed;                 // Serving, and their directory is gone.
  std::set<Key> present;                    // Every version the scan found.
  std::set<std::string> malformed;  // Left as they are: their directory is not readable as a model.
};

namespace {

RepositoryDiff Diff(const RepositoryScan& scan, const ModelSet& current,
                    const std::map<Key, std::string>& fingerprints) {
  RepositoryDiff d;
  for (const auto& [name, why] : scan.errors) d.malformed.insert(name);
  for (const ModelSource& source : scan.sources) {
    const Key key{source.name, source.version};
    d.present.insert(key);
    const auto fp = fingerprints.find(key);
    const bool unchanged = current.Find(source.name, source.version) && fp != fingerprints.end() &&
                           fp->second == source.fingerprint;
    if (!unchanged) d.to_load.push_back(&source);
  }
  for (const auto& [name, versions] : current.models) {
    if (d.malformed.count(name)) continue;
    for (const auto& [version, model] : versions) {
      if (!d.present.count({name, version})) d.removed.push_back({name, version});
    }
  }
  return d;
}

}  // namespace

ReloadReport ModelRepository::Reload() {
  ReloadReport report;
  StatusOr<RepositoryScan> scan = ScanModelRepository(dir_);
  const std::shared_ptr<const ModelSet> current = Snapshot();
  report.models_served = static_cast<int>(current->versions());
  if (!scan.ok()) {
    report.status = scan.status();
    return report;
  }
  const RepositoryDiff diff = Diff(*scan, *current, fingerprints_);
  for (const auto& [name, why] : scan->errors) {
    failures_[{name, 0}] = why;
    report.changes.push_back({name, 0, RepositoryChange::Action::kFailed, "", why});
  }
  auto next = std::make_shared<ModelSet>(*current);
  Published published;
  if (!LoadChanged(diff, *current, next.get(), &published.loaded, &report)) return report;
  for (const auto& [name, version] : diff.removed) {
    published.unloaded.push_back(current->Find(name, version));
    next->models[name].erase(version);
    if (next->models[name].empty()) next->models.erase(name);
    report.changes.push_back({name, version, RepositoryChange::Action::kUnloaded, "", ""});
  }
  // Failures of versions whose directories are gone (or, for a whole model, that read again) end.
  for (auto it = failures_.begin(); it != failures_.end();) {
    const bool gone = it->first.second == 0 ? !diff.malformed.count(it->first.first)
                                            : !diff.present.count(it->first);
    it = gone ? failures_.erase(it) : std::next(it);
  }
  if (next->versions() == 0) {
    report.changes.erase(std::remove_if(report.changes.begin(), report.changes.end(),
                                        [](const RepositoryChange& c) {
                                          return c.action != RepositoryChange::Action::kFailed;
                                        }),
                         report.changes.end());
    report.status =
        Status(StatusCode::kFailedPrecondition,
               "reload: --models " + dir_ + " would leave no model to serve; nothing was changed");
    return report;
  }
  for (const auto& model : published.unloaded)
    fingerprints_.erase({model->spec().name, model->spec().version});
  report.models_served = static_cast<int>(next->versions());
  Publish(next);
  Announce(published);
  return report;
}

bool ModelRepository::LoadChanged(const RepositoryDiff& diff, const ModelSet& current,
                                  ModelSet* next, std::vector<Replacement>* loaded,
                                  ReloadReport* report) {
  for (const ModelSource* source : diff.to_load) {
    WarmRunner run;
    {
      std::lock_guard<std::mutex> lock(mu_);
      run = warm_runner_;
      if (stopping_) {
        report->status = Unavailable("reload: the server is shutting down; nothing was changed");
        return false;
      }
    }
    const Key key{source->name, source->version};
    const auto previous = current.Find(source->name, source->version);
    StatusOr<std::shared_ptr<const AttentionModel>> model = Build(*source, engine_, warmup_, run);
    if (!model.ok()) {
      failures_[key] = model.status().message();
      report->changes.push_back({source->name, source->version, RepositoryChange::Action::kFailed,
                                 previous ? previous->spec().weights_hash : "",
                                 model.status().message()});
      continue;
    }
    failures_.erase(key);
    fingerprints_[key] = source->fingerprint;
    if (previous && SameModel(previous->spec(), (*model)->spec()))
      continue;  // Touched, not changed.
    next->models[source->name][source->version] = *model;
    report->changes.push_back(
        {source->name, source->version,
         previous ? RepositoryChange::Action::kUpdated : RepositoryChange::Action::kLoaded,
         (*model)->spec().weights_hash, ""});
    loaded->emplace_back(*model, previous);
  }
  return true;
}

void ModelRepository::Announce(const Published& published) {
  ModelRepositoryHooks hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hooks = hooks_;
  }
  for (const auto& [model, replaced] : published.loaded) {
    if (hooks.on_loaded) hooks.on_loaded(model->spec(), replaced ? &replaced->spec() : nullptr);
  }
  for (const auto& model : published.unloaded) {
    if (hooks.on_unloaded) hooks.on_unloaded(model->spec());
  }
}

}  // namespace attnserve
