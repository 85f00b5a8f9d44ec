#include "server/models/model_loader.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "server/engine/attention_model.h"
#include "server/weights/checkpoint.h"
#include "server/weights/safetensors.h"
#include "server/weights/torch_archive.h"

namespace attnserve {
namespace fs = std::filesystem;
namespace {

Status Fail(const std::string& what) { return {StatusCode::kFailedPrecondition, what}; }

// More heads than this is no model anyone trains; it also keeps head arithmetic far from overflow.
constexpr int64_t kMaxHeads = 1 << 16;

bool IsWeightsFile(const fs::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".safetensors" || ext == ".pt" || ext == ".pth";
}

// One ModelQueuePolicy object.
StatusOr<QueuePolicy> ParseQueuePolicy(const nlohmann::json& j, const std::string& field) {
  if (!j.is_object()) return Fail(field + ": expected an object");
  QueuePolicy p;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = field + "." + it.key();
    if (it.key() == "max_queue_size") {
      ASSIGN_OR_RETURN(p.max_queue_size, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "default_timeout_microseconds") {
      ASSIGN_OR_RETURN(p.default_timeout_us, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "allow_timeout_override") {
      if (!it->is_boolean()) return Fail(key + ": expected true or false");
      p.allow_timeout_override = it->get<bool>();
    } else if (it.key() == "timeout_action") {
      if (!it->is_string() || !ParseTimeoutAction(it->get<std::string>(), &p.timeout_action)) {
        return Fail(key + " is " + it->dump() + "; expected \"REJECT\" or \"DELAY\"");
      }
    } else {
      return Fail(field + ": unknown key '" + it.key() +
                  "'; allowed: max_queue_size, default_timeout_microseconds, "
                  "allow_timeout_override, timeout_action");
    }
  }
  return p;
}

// "dynamic_batching": the priority levels and their queues.
StatusOr<PriorityOptions> ParsePriorities(const nlohmann::json& j, const std::string& where) {
  const std::string field = where + ": dynamic_batching";
  if (!j.is_object()) return Fail(field + ": expected an object");
  PriorityOptions p;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = field + "." + it.key();
    if (it.key() == "priority_levels") {
      ASSIGN_OR_RETURN(p.levels, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "default_priority_level") {
      ASSIGN_OR_RETURN(p.default_level, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "default_queue_policy") {
      ASSIGN_OR_RETURN(p.default_policy, ParseQueuePolicy(*it, key));
    } else if (it.key() == "priority_queue_policy") {
      if (!it->is_object()) return Fail(key + ": expected an object of levels");
      for (auto l = it->begin(); l != it->end(); ++l) {
        const std::string level = l.key();
        if (level.empty() || level.size() > 9 ||
            level.find_first_not_of("0123456789") != std::string::npos) {
          return Fail(key + ": '" + level.substr(0, 32) + "' is not a level number");
        }
        ASSIGN_OR_RETURN(p.level_policies[std::stoll(level)],
                         ParseQueuePolicy(*l, key + "['" + level + "']"));
      }
    } else {
      return Fail(field + ": unknown key '" + it.key() +
                  "'; allowed: priority_levels, default_priority_level, default_queue_policy, "
                  "priority_queue_policy");
    }
  }
  RETURN_IF_ERROR(p.Validate(field));
  return p;
}

}  // namespace

StatusOr<ModelDirConfig> ParseModelConfig(const std::string& text, const std::string& config_path) {
  ASSIGN_OR_RETURN(nlohmann::json j, ParseStrictJson(text, config_path));
  if (!j.is_object()) return Fail(config_path + ": not a JSON object");
  static const char* kKnown[] = {"num_heads",        "weights",    "add_zero_attn",
                                 "dynamic_batching", "checkpoint", "layer"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find_if(std::begin(kKnown), std::end(kKnown),
                     [&](const char* k) { return it.key() == k; }) == std::end(kKnown)) {
      return Fail(config_path + ": unknown key '" + it.key() +
                  "'; allowed: num_heads, weights, add_zero_attn, dynamic_batching, checkpoint, "
                  "layer");
    }
  }
  ModelDirConfig out;
  ModelConfig& config = out.config;
  config.source = config_path;
  if (j.contains("dynamic_batching")) {
    ASSIGN_OR_RETURN(out.priorities, ParsePriorities(j["dynamic_batching"], config_path));
  }
  // A layer of a decoder checkpoint: its own config.json says the rest.
  if (j.contains("checkpoint") || j.contains("layer")) {
    for (const char* key : {"num_heads", "weights", "add_zero_attn"}) {
      if (j.contains(key)) {
        return Fail(config_path + ": " + key +
                    " comes from the checkpoint's own config.json with \"checkpoint\"; remove it");
      }
    }
    if (!j.contains("checkpoint") || !j["checkpoint"].is_string() ||
        j["checkpoint"].get<std::string>().empty()) {
      return Fail(config_path + ": checkpoint must name the checkpoint's directory");
    }
    if (!j.contains("layer"))
      return Fail(config_path + ": layer (which of the checkpoint's layers) is required");
    ASSIGN_OR_RETURN(out.layer, NonNegativeJsonInt(j["layer"], config_path + ": layer"));
    out.checkpoint = j["checkpoint"].get<std::string>();
    return out;
  }
  if (!j.contains("num_heads") || !j["num_heads"].is_number_integer()) {
    return Fail(config_path + ": num_heads (an integer) is required");
  }
  // An unsigned value above INT64_MAX would wrap to a negative int64: read it as what it is.
  const nlohmann::json& heads = j["num_heads"];
  if ((heads.is_number_unsigned() && heads.get<uint64_t>() > kMaxHeads) ||
      (!heads.is_number_unsigned() &&
       (heads.get<int64_t>() < 1 || heads.get<int64_t>() > kMaxHeads))) {
    return Fail(config_path + ": num_heads " + heads.dump() + " is out of range; expected 1 to " +
                std::to_string(kMaxHeads));
  }
  config.num_heads = heads.get<int64_t>();
  if (j.contains("add_zero_attn")) {
    if (!j["add_zero_attn"].is_boolean())
      return Fail(config_path + ": add_zero_attn must be true or false");
    config.add_zero_attn = j["add_zero_attn"].get<bool>();
  }
  if (j.contains("weights")) {
    if (!j["weights"].is_string() || j["weights"].get<std::string>().empty()) {
      return Fail(config_path + ": weights must be a file name");
    }
    out.weights = j["weights"].get<std::string>();
  }
  return out;
}

StatusOr<ModelWeights> LoadModel(const std::string& model_dir, const std::string& name,
                                 int64_t version) {
  const fs::path dir(model_dir);
  const std::string config_path = (dir / "config.json").string();
  ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path, 1 << 20));
  ASSIGN_OR_RETURN(ModelDirConfig parsed, ParseModelConfig(config_text, config_path));
  if (!parsed.checkpoint.empty()) {
    ASSIGN_OR_RETURN(ModelWeights w,
                     LoadCheckpointLayer((dir / parsed.checkpoint).string(), parsed.layer));
    w.spec.name = name;
    w.spec.version = version;
    w.spec.priorities = parsed.priorities;
    return w;
  }
  const ModelConfig& config = parsed.config;
  fs::path weights_path;
  if (!parsed.weights.empty()) {
    weights_path = dir / parsed.weights;
  } else {
    std::vector<fs::path> found;
    std::error_code ec;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      std::error_code file_ec;
      if (it->is_regular_file(file_ec) && IsWeightsFile(it->path())) found.push_back(it->path());
    }
    if (ec) return Fail(model_dir + ": cannot list: " + ec.message());
    if (found.size() != 1) {
      return Fail(config_path + ": found " + std::to_string(found.size()) +
                  " weights files (.safetensors, .pt, .pth); name one with \"weights\"");
    }
    weights_path = found[0];
  }
  const std::string where = weights_path.string();
  ASSIGN_OR_RETURN(std::string bytes, ReadFile(where));
  NamedTensors tensors;
  if (bytes.size() >= 2 && bytes[0] == 'P' && bytes[1] == 'K') {  // torch.save's zip format.
    ASSIGN_OR_RETURN(tensors, ParseTorchArchive(bytes, where));
  } else if (weights_path.extension() == ".safetensors") {
    ASSIGN_OR_RETURN(tensors, ParseSafetensors(bytes, where));
  } else {
    return Fail(where +
                ": neither a safetensors file (by its name) nor a torch.save() zip archive");
  }
  ASSIGN_OR_RETURN(ModelWeights w, CanonicalizeWeights(tensors, config, where));
  w.spec.name = name;
  w.spec.version = version;
  w.spec.source = where;
  w.spec.priorities = parsed.priorities;
  return w;
}

namespace {

// config.json's bytes, then every other regular file's name, size and modification time.
std::string Fingerprint(const fs::path& dir) {
  std::string fp;
  StatusOr<std::string> config = ReadFile((dir / "config.json").string(), 1 << 20);
  fp = config.ok() ? *config : "unreadable config.json: " + config.status().message();
  std::vector<std::string> entries;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    std::error_code file_ec;
    if (!it->is_regular_file(file_ec) || it->path().filename() == "config.json") continue;
    const auto size = it->file_size(file_ec);
    const auto mtime = it->last_write_time(file_ec).time_since_epoch().count();
    entries.push_back(it->path().filename().string() + "\n" + std::to_string(size) + "\n" +
                      std::to_string(mtime));
  }
  if (ec) entries.push_back("cannot list: " + ec.message());
  // A layer of a checkpoint: the checkpoint's files too (its weights may change in place).
  if (config.ok()) {
    StatusOr<ModelDirConfig> parsed = ParseModelConfig(*config, (dir / "config.json").string());
    if (parsed.ok() && !parsed->checkpoint.empty()) {
      const fs::path checkpoint = dir / parsed->checkpoint;
      std::error_code cec;
      for (auto it = fs::directory_iterator(checkpoint, cec);
           !cec && it != fs::directory_iterator(); it.increment(cec)) {
        std::error_code file_ec;
        if (!it->is_regular_file(file_ec)) continue;
        entries.push_back("checkpoint/" + it->path().filename().string() + "\n" +
                          std::to_string(it->file_size(file_ec)) + "\n" +
                          std::to_string(it->last_write_time(file_ec).time_since_epoch().count()));
      }
    }
  }
  std::sort(entries.begin(), entries.end());
  for (const std::string& e : entries) fp += "\n" + e;
  return fp;
}

// A version directory's name: a positive integer without a leading zero, at most 18 digits.
bool ParseVersion(const std::string& s, int64_t* version) {
  if (s.empty() || s.size() > 18 || s[0] == '0') return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  *version = std::stoll(s);
  return true;
}

}  // namespace

StatusOr<RepositoryScan> ScanModelRepository(const std::string& dir) {
  // Every filesystem call reports through an error_code: a symbolic-link loop or an unreadable
  // entry is a refusal naming the path, never an escaped exception.
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return Fail("--models " + dir + ": not a directory" + (ec ? " (" + ec.message() + ")" : ""));
  }
  std::vector<fs::path> model_dirs;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    std::error_code entry_ec;
    const bool is_dir = it->is_directory(entry_ec);
    if (entry_ec)
      return Fail("--models " + dir + ": " + it->path().string() + ": " + entry_ec.message());
    if (is_dir) model_dirs.push_back(it->path());
  }
  if (ec) return Fail("--models " + dir + ": cannot list: " + ec.message());
  std::sort(model_dirs.begin(), model_dirs.end());
  RepositoryScan scan;
  for (const fs::path& model_dir : model_dirs) {
    const std::string name = model_dir.filename().string();
    const auto error = [&](const std::string& why) { scan.errors.emplace_back(name, why); };
    std::error_code entry_ec;
    const bool unversioned = fs::exists(model_dir / "config.json", entry_ec);
    if (entry_ec) {
      error((model_dir / "config.json").string() + ": " + entry_ec.message());
      continue;
    }
    std::vector<std::pair<int64_t, fs::path>> versions;
    std::string bad;
    for (auto it = fs::directory_iterator(model_dir, entry_ec);
         !entry_ec && it != fs::directory_iterator(); it.increment(entry_ec)) {
      std::error_code e;
      const std::string sub = it->path().filename().string();
      if (!fs::is_directory(it->path(), e) || !fs::exists(it->path() / "config.json", e)) continue;
      int64_t v = 0;
      if (ParseVersion(sub, &v)) {
        versions.emplace_back(v, it->path());
      } else if (!sub.empty() && sub.find_first_not_of("0123456789") == std::string::npos) {
        bad = it->path().string() + ": not a version number (1, 2, ... without leading zeros)";
      }
    }
    if (entry_ec) {
      error(model_dir.string() + ": cannot list: " + entry_ec.message());
      continue;
    }
    if (!bad.empty()) {
      error(bad);
      continue;
    }
    if (unversioned && !versions.empty()) {
      error(model_dir.string() + ": has both config.json and version directories (" +
            versions.front().second.filename().string() +
            "/); keep one layout: move the files into " + model_dir.string() + "/1/");
      continue;
    }
    if (unversioned) versions.emplace_back(1, model_dir);
    std::sort(versions.begin(), versions.end());
    for (const auto& [v, path] : versions) {
      scan.sources.push_back({name, v, path.string(), Fingerprint(path)});
    }
  }
  return scan;
}

StatusOr<std::vector<ModelWeights>> LoadModelDirectory(const std::string& dir,
                                                       RepositoryScan* scan_out) {
  ASSIGN_OR_RETURN(RepositoryScan scan, ScanModelRepository(dir));
  if (!scan.errors.empty()) return Fail("--models " + dir + ": " + scan.errors.front().second);
  if (scan.sources.empty()) {
    return Fail("--models " + dir +
                ": no model found (expected subdirectories with a config.json, "
                "or with version directories 1/, 2/, ... holding one)");
  }
  std::vector<ModelWeights> models;
  for (const ModelSource& source : scan.sources) {
    ASSIGN_OR_RETURN(ModelWeights w, LoadModel(source.dir, source.name, source.version));
    models.push_back(std::move(w));
  }
  if (scan_out) *scan_out = std::move(scan);
  return models;
}

}  // namespace attnserve
