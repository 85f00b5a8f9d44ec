#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/core/status.h"
#include "server/engine/attention_model.h"
#include "server/models/warmup.h"

namespace attnserve {

/// The models being served at one moment: name -> version -> model. Never changed once published:
/// a reload publishes a new set. A request holds its model's shared_ptr until answered, so a model
/// that a reload replaced or removed finishes what it accepted and unloads after its last answer.
struct ModelSet {
  std::map<std::string, std::map<int64_t, std::shared_ptr<const AttentionModel>>> models;

  /// `version` 0 = the highest loaded. nullptr when absent.
  std::shared_ptr<const AttentionModel> Find(const std::string& name, int64_t version) const;
  /// Find, or the reason: INVALID_ARGUMENT for a negative version, NOT_FOUND naming what the set
  /// holds. `name_field` and `version_field` are the request's field names, for the message.
  StatusOr<std::shared_ptr<const AttentionModel>> Lookup(
      const std::string& name, int64_t version, const char* name_field = "model",
      const char* version_field = "model_version") const;
  /// "a, b, c": the names, for messages.
  std::string Names() const;
  size_t versions() const;
};

/// What one reload did to one version of one model.
struct RepositoryChange {
  enum class Action { kLoaded, kUpdated, kUnloaded, kFailed };
  std::string name;
  int64_t version = 0;  ///< 0 when a model directory as a whole was malformed.
  Action action = Action::kLoaded;
  std::string weights_hash;  ///< Serving under this name and version now; "" when none.
  std::string message;       ///< kFailed: why, naming the file.
};

/// One reload's outcome. `status` is not OK when nothing was done (no repository, unreadable, the
/// server stopping, or a result that would serve no model); per-version failures are `changes`.
struct ReloadReport {
  Status status;
  std::vector<RepositoryChange> changes;
  int models_served = 0;
  bool failed() const;  ///< status not OK, or any change kFailed.
};

/// What the server learns from the repository, called on the reloading thread after a publish.
struct ModelRepositoryHooks {
  /// A version now serves (new, or the new weights of a changed one; `replaced` is what it
  /// replaced, or nullptr).
  std::function<void(const ModelSpec& loaded, const ModelSpec* replaced)> on_loaded;
  /// A version left the set (it still finishes what it accepted).
  std::function<void(const ModelSpec& removed)> on_unloaded;
  /// Once per reload, after the publish: the report, the set now serving, and every model name
  /// whose latest load failed (kept until a later load of it succeeds or its directory goes).
  std::function<void(const ReloadReport&, const ModelSet&,
                     const std::map<std::string, std::string>&)>
      on_reloaded;
};

struct RepositoryDiff;  // What a rescan changes (model_repository.cc).

/// The served models and their reloads. Start-up loads every version (any failure refuses to
/// start); afterwards RequestReload rescans the directory on a background thread: new and changed
/// versions load there while the old ones serve, then one atomic publish swaps the set.
/// Thread-safe.
class ModelRepository {
 public:
  /// `dir` "" serves the built-in demo model (nothing to reload). The models opened are not warmed
  /// (Warm does it); every version a reload loads is warmed for `warmup` before it serves.
  static StatusOr<std::unique_ptr<ModelRepository>> Open(
      const std::string& dir, const EngineOptions& engine,
      const WarmupShapes& warmup = WarmupShapes::Off());

  /// Warms every version serving now (WarmModel): the first failure, naming the model.
  Status Warm();
  /// How warm-ups compute from now on (the server's batcher); set before Warm and any reload.
  void SetWarmRunner(WarmRunner run);
  ~ModelRepository();  ///< Stops.

  /// The set serving now: cheap (a shared_ptr copy under a mutex); hold it as long as needed.
  std::shared_ptr<const ModelSet> Snapshot() const;

  /// Hooks for the reloads to come; set once, before the first RequestReload.
  void SetHooks(ModelRepositoryHooks hooks);

  /// Asks for a rescan. `done` (may be empty) runs on the reloading thread with the report of a
  /// reload that started after this call. Requests that arrive during a reload share the next one.
  void RequestReload(std::function<void(const ReloadReport&)> done);

  /// Ends the reloading thread: a reload in progress stops before its next load; reloads not yet
  /// started are answered UNAVAILABLE. Idempotent.
  void Stop();

  const std::string& dir() const { return dir_; }

 private:
  ModelRepository(std::string dir, EngineOptions engine, WarmupShapes warmup);
  void Loop();
  // A rescan: what changed (a pure diff against the set serving), those versions loaded, then one
  // publish and the hooks told.
  ReloadReport Reload();
  // (new, replaced or nullptr)
  using Replacement =
      std::pair<std::shared_ptr<const AttentionModel>, std::shared_ptr<const AttentionModel>>;
  struct Published {
    std::vector<Replacement> loaded;
    std::vector<std::shared_ptr<const AttentionModel>> unloaded;
  };
  // Loads the diff's new and changed versions into `next`; false when the server began stopping
  // (report->status says so; nothing may be published).
  bool LoadChanged(const RepositoryDiff& diff, const ModelSet& current, ModelSet* next,
                   std::vector<Replacement>* loaded, ReloadReport* report);
  void Announce(const Published& published);
  void Publish(std::shared_ptr<const ModelSet> set);

  const std::string dir_;
  const EngineOptions engine_;
  const WarmupShapes warmup_;
  WarmRunner warm_runner_;  // Under mu_ (a reload may start before it is set).
  ModelRepositoryHooks hooks_;

  mutable std::mutex set_mu_;
  std::shared_ptr<const ModelSet> set_;

  // Reloading thread state. fingerprints_ and failures_ are its own (no lock needed).
  std::map<std::pair<std::string, int64_t>, std::string> fingerprints_;
  // (name, version) -> latest load error; version 0: the model directory as a whole.
  std::map<std::pair<std::string, int64_t>, std::string> failures_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void(const ReloadReport&)>> pending_;
  bool requested_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace attnserve
