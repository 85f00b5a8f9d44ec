#include "server/engine/model_loader.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "server/engine/attention_model.h"
#include "server/engine/safetensors.h"
#include "server/engine/torch_archive.h"

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

}  // namespace

StatusOr<ModelDirConfig> ParseModelConfig(const std::string& text, const std::string& config_path) {
  ASSIGN_OR_RETURN(nlohmann::json j, ParseStrictJson(text, config_path));
  if (!j.is_object()) return Fail(config_path + ": not a JSON object");
  static const char* kKnown[] = {"num_heads", "weights", "add_zero_attn"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find_if(std::begin(kKnown), std::end(kKnown),
                     [&](const char* k) { return it.key() == k; }) == std::end(kKnown)) {
      return Fail(config_path + ": unknown key '" + it.key() +
                  "'; allowed: num_heads, weights, add_zero_attn");
    }
  }
  ModelDirConfig out;
  ModelConfig& config = out.config;
  if (!j.contains("num_heads") || !j["num_heads"].is_number_integer()) {
    return Fail(config_path + ": num_heads (an integer) is required");
  }
  // An unsigned value above INT64_MAX would wrap to a negative int64: read it as what it is.
  const nlohmann::json& heads = j["num_heads"];
  if ((heads.is_number_unsigned() && heads.get<uint64_t>() > kMaxHeads) ||
      (!heads.is_number_unsigned() && (heads.get<int64_t>() < 1 || heads.get<int64_t>() > kMaxHeads))) {
    return Fail(config_path + ": num_heads " + heads.dump() + " is out of range; expected 1 to " +
                std::to_string(kMaxHeads));
  }
  config.num_heads = heads.get<int64_t>();
  config.source = config_path;
  if (j.contains("add_zero_attn")) {
    if (!j["add_zero_attn"].is_boolean()) return Fail(config_path + ": add_zero_attn must be true or false");
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

StatusOr<ModelWeights> LoadModel(const std::string& model_dir, const std::string& name) {
  const fs::path dir(model_dir);
  const std::string config_path = (dir / "config.json").string();
  ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path, 1 << 20));
  ASSIGN_OR_RETURN(ModelDirConfig parsed, ParseModelConfig(config_text, config_path));
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
    return Fail(where + ": neither a safetensors file (by its name) nor a torch.save() zip archive");
  }
  ASSIGN_OR_RETURN(ModelWeights w, CanonicalizeWeights(tensors, config, where));
  w.spec.name = name;
  w.spec.source = where;
  return w;
}

StatusOr<std::vector<ModelWeights>> LoadModelDirectory(const std::string& dir) {
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
    const fs::path config = it->path() / "config.json";
    const bool is_dir = it->is_directory(entry_ec);
    if (entry_ec) return Fail("--models " + dir + ": " + it->path().string() + ": " + entry_ec.message());
    if (!is_dir) continue;
    const bool has_config = fs::exists(config, entry_ec);
    if (entry_ec) return Fail("--models " + dir + ": " + config.string() + ": " + entry_ec.message());
    if (has_config) model_dirs.push_back(it->path());
  }
  if (ec) return Fail("--models " + dir + ": cannot list: " + ec.message());
  std::sort(model_dirs.begin(), model_dirs.end());
  if (model_dirs.empty()) {
    return Fail("--models " + dir + ": no model found (expected subdirectories with a config.json)");
  }
  std::vector<ModelWeights> models;
  for (const auto& p : model_dirs) {
    ASSIGN_OR_RETURN(ModelWeights w, LoadModel(p.string(), p.filename().string()));
    models.push_back(std::move(w));
  }
  return models;
}

}  // namespace attnserve
