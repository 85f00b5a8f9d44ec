#include "server/weights/checkpoint.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "server/core/files.h"
#include "server/weights/safetensors.h"

namespace attnserve {
namespace fs = std::filesystem;
namespace {

Status Fail(const std::string& what) { return {StatusCode::kFailedPrecondition, what}; }

constexpr int64_t kMaxHeads = 1 << 16, kMaxWidth = 1 << 20;

// One family's defaults, for keys its config.json leaves out (transformers writes only what
// differs from them).
struct Family {
  int64_t hidden = 4096, heads = 32, layers = 32, max_positions = 2048;
  int64_t kv_heads = 0;  // 0: num_attention_heads
  int64_t head_dim = 0;  // 0: hidden / heads
  bool qkv_bias = false, bias_key = false, qk_norm = false, qwen_window = false;
};

const std::map<std::string, Family>& Families() {
  static const std::map<std::string, Family> families = [] {
    std::map<std::string, Family> f;
    Family llama;
    llama.bias_key = true;
    f["llama"] = llama;
    Family mistral;
    mistral.kv_heads = 8;
    mistral.max_positions = 4096 * 32;
    f["mistral"] = mistral;
    Family qwen2;
    qwen2.kv_heads = 32;
    qwen2.max_positions = 32768;
    qwen2.qkv_bias = true;
    qwen2.qwen_window = true;
    f["qwen2"] = qwen2;
    Family qwen3 = qwen2;
    qwen3.head_dim = 128;
    qwen3.qkv_bias = false;
    qwen3.bias_key = true;
    qwen3.qk_norm = true;
    f["qwen3"] = qwen3;
    return f;
  }();
  return families;
}

// Reads config keys with their messages.
struct Keys {
  const nlohmann::json& j;
  const std::string& where;
  StatusOr<int64_t> Int(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) const {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    const nlohmann::json& v = j[key];
    // nlohmann reads every non-negative integer as unsigned: both bounds apply to either kind.
    const bool in_range =
        v.is_number_unsigned()
            ? v.get<uint64_t>() <= uint64_t(hi) && (lo <= 0 || v.get<uint64_t>() >= uint64_t(lo))
            : v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
    if (!in_range) {
      return Fail(where + ": " + key + " is " + v.dump() + "; expected an integer from " +
                  std::to_string(lo) + " to " + std::to_string(hi));
    }
    return v.get<int64_t>();
  }
  StatusOr<bool> Bool(const std::string& key, bool fallback) const {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_boolean())
      return Fail(where + ": " + key + " is " + j[key].dump() + "; expected true or false");
    return j[key].get<bool>();
  }
};

StatusOr<double> Number(const nlohmann::json& obj, const std::string& key, double fallback,
                        const std::string& where, bool positive = true) {
  if (!obj.contains(key) || obj[key].is_null()) return fallback;
  const nlohmann::json& v = obj[key];
  if (!v.is_number() || !std::isfinite(v.get<double>()) || (positive && v.get<double>() <= 0)) {
    return Fail(where + ": " + key + " is " + v.dump() + "; expected a " +
                (positive ? "positive " : "") + "number");
  }
  return v.get<double>();
}

// RoPE's inverse frequencies are computed in float32 (by transformers, and as it does by
// rotary.cc): a rope_theta or llama3 factor positive as a double may be 0 there, or make a
// frequency overflow (1e-300), and every answer would be NaN. The same float32 steps here, each
// result required finite.
Status CheckFrequencies(const RotarySpec& r, const std::string& field) {
  const float theta = static_cast<float>(r.theta), factor = static_cast<float>(r.factor);
  const float low = static_cast<float>(r.low_freq_factor),
              high = static_cast<float>(r.high_freq_factor);
  const float old_len = static_cast<float>(r.original_max_position);
  for (int64_t i = 0; i < r.rotary_dim; i += 2) {
    const float inv =
        1.0f / std::pow(theta, static_cast<float>(i) / static_cast<float>(r.rotary_dim));
    if (!std::isfinite(inv)) {
      return Fail(field + ": rope_theta " + nlohmann::json(r.theta).dump() +
                  " gives inverse frequencies that are not finite in float32 (where they are "
                  "computed); expected a rope_theta float32 holds, such as 10000");
    }
    if (r.type != "llama3") continue;
    const float wavelen = static_cast<float>(2 * M_PI) / inv;
    const float scaled = wavelen > old_len / low ? inv / factor : inv;
    const float smooth = (old_len / wavelen - low) / (high - low);
    const float smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    const bool medium = wavelen >= old_len / high && wavelen <= old_len / low;
    if (!std::isfinite(medium ? smoothed : scaled)) {
      return Fail(field + ": factor " + nlohmann::json(r.factor).dump() +
                  " gives inverse frequencies that are not finite in float32 (where they are "
                  "computed); expected a factor float32 holds, such as 8");
    }
  }
  return Status::Ok();
}

// RoPE from rope_parameters (transformers 5) or rope_theta / rope_scaling (older checkpoints).
StatusOr<RotarySpec> ParseRotary(const nlohmann::json& j, int64_t head_dim, int64_t max_positions,
                                 const std::string& where) {
  nlohmann::json params = nlohmann::json::object();
  std::string params_key;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (j.contains(key) && !j[key].is_null()) {
      if (!j[key].is_object()) return Fail(where + ": " + key + " must be an object");
      params = j[key];
      params_key = key;
      break;
    }
  }
  const std::string field = where + ": " + (params_key.empty() ? "rope" : params_key);
  for (auto it = params.begin(); it != params.end(); ++it) {
    if (it->is_object()) {
      return Fail(field + " holds '" + it.key() +
                  "': RoPE per layer type is not served; expected one set of parameters");
    }
  }
  RotarySpec r;
  ASSIGN_OR_RETURN(const double top_theta, Number(j, "rope_theta", 10000.0, where));
  ASSIGN_OR_RETURN(r.theta, Number(params, "rope_theta", top_theta, field));
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (params.contains(key)) {
      if (!params[key].is_string()) return Fail(field + "." + key + " must be a string");
      type = params[key].get<std::string>();
      break;
    }
  }
  if (type != "default" && type != "llama3") {
    return Fail(field + ": rope_type '" + type +
                "' is not served; attnserve computes \"default\" and \"llama3\"");
  }
  r.type = type;
  ASSIGN_OR_RETURN(const double top_partial, Number(j, "partial_rotary_factor", 1.0, where));
  ASSIGN_OR_RETURN(const double partial,
                   Number(params, "partial_rotary_factor", top_partial, field));
  if (partial > 1)
    return Fail(field + ": partial_rotary_factor " + std::to_string(partial) + " is over 1");
  r.rotary_dim = static_cast<int64_t>(static_cast<double>(head_dim) * partial);  // Python's int().
  if (r.rotary_dim < 2 || r.rotary_dim % 2 != 0) {
    return Fail(field + ": rotary dimensions head_dim x partial_rotary_factor = " +
                std::to_string(r.rotary_dim) + "; expected an even number of at least 2");
  }
  if (type == "llama3") {
    for (const char* key : {"factor", "low_freq_factor", "high_freq_factor"}) {
      if (!params.contains(key)) return Fail(field + ": rope_type llama3 needs " + key);
    }
    ASSIGN_OR_RETURN(r.factor, Number(params, "factor", 1, field));
    ASSIGN_OR_RETURN(r.low_freq_factor, Number(params, "low_freq_factor", 1, field));
    ASSIGN_OR_RETURN(r.high_freq_factor, Number(params, "high_freq_factor", 4, field));
    if (r.high_freq_factor <= r.low_freq_factor) {
      return Fail(field + ": high_freq_factor must be above low_freq_factor");
    }
    const Keys top{j, where};
    ASSIGN_OR_RETURN(const int64_t original_top,
                     top.Int("original_max_position_embeddings", max_positions, 1, INT64_MAX));
    const Keys in{params, field};
    ASSIGN_OR_RETURN(r.original_max_position,
                     in.Int("original_max_position_embeddings", original_top, 1, INT64_MAX));
  }
  RETURN_IF_ERROR(CheckFrequencies(r, field));
  return r;
}

// Sliding windows: Mistral's on every layer (null: none); Qwen2/Qwen3's only with
// use_sliding_window, on the layers layer_types names (by default those from max_window_layers).
StatusOr<int64_t> ParseWindow(const nlohmann::json& j, const std::string& type, int64_t layer,
                              int64_t layers, const std::string& where) {
  const Keys k{j, where};
  if (type == "mistral") {  // A null sliding_window (written as null) is no window.
    const bool null_window = j.contains("sliding_window") && j["sliding_window"].is_null();
    return k.Int("sliding_window", null_window ? 0 : 4096, 1, INT64_MAX);
  }
  if (!Families().at(type).qwen_window) return 0;
  ASSIGN_OR_RETURN(const bool use, k.Bool("use_sliding_window", false));
  if (!use) return 0;
  ASSIGN_OR_RETURN(const int64_t window, k.Int("sliding_window", 4096, 1, INT64_MAX));
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const nlohmann::json& types = j["layer_types"];
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers ||
        !types[layer].is_string()) {
      return Fail(where + ": layer_types must list one string per layer (" +
                  std::to_string(layers) + ")");
    }
    return types[layer].get<std::string>() == "sliding_attention" ? window : 0;
  }
  ASSIGN_OR_RETURN(const int64_t max_window_layers, k.Int("max_window_layers", 28, 0, INT64_MAX));
  return layer >= max_window_layers ? window : 0;
}

}  // namespace

StatusOr<ModelSpec> ParseCheckpointConfig(const std::string& text, int64_t layer,
                                          const std::string& where) {
  ASSIGN_OR_RETURN(nlohmann::json j, ParseStrictJson(text, where));
  if (!j.is_object()) return Fail(where + ": not a JSON object");
  if (!j.contains("model_type") || !j["model_type"].is_string()) {
    return Fail(where +
                ": model_type (a string) is required; attnserve serves llama, mistral, "
                "qwen2 and qwen3");
  }
  const std::string type = j["model_type"].get<std::string>();
  const auto family_it = Families().find(type);
  if (family_it == Families().end()) {
    return Fail(where + ": model_type '" + type +
                "' is not served; expected llama, mistral, qwen2 or qwen3");
  }
  const Family& f = family_it->second;
  const Keys k{j, where};
  ModelSpec spec;
  DecoderSpec d;
  d.family = type;
  ASSIGN_OR_RETURN(spec.embed_dim, k.Int("hidden_size", f.hidden, 1, kMaxWidth));
  ASSIGN_OR_RETURN(spec.num_heads, k.Int("num_attention_heads", f.heads, 1, kMaxHeads));
  ASSIGN_OR_RETURN(
      d.num_kv_heads,
      k.Int("num_key_value_heads", f.kv_heads > 0 ? f.kv_heads : spec.num_heads, 1, kMaxHeads));
  if (spec.num_heads % d.num_kv_heads != 0) {
    return Fail(where + ": num_key_value_heads " + std::to_string(d.num_kv_heads) +
                " does not divide num_attention_heads " + std::to_string(spec.num_heads));
  }
  const int64_t split = spec.embed_dim / spec.num_heads;
  ASSIGN_OR_RETURN(spec.head_size,
                   k.Int("head_dim", f.head_dim > 0 ? f.head_dim : split, 1, kMaxWidth));
  if (spec.head_size == 0 || spec.num_heads * spec.head_size > kMaxWidth) {
    return Fail(where + ": num_attention_heads x head_dim = " +
                std::to_string(spec.num_heads * spec.head_size) + "; expected 1 to " +
                std::to_string(kMaxWidth));
  }
  ASSIGN_OR_RETURN(const int64_t layers, k.Int("num_hidden_layers", f.layers, 1, kMaxHeads));
  if (layer < 0 || layer >= layers) {
    return Fail(where + ": layer " + std::to_string(layer) +
                " does not exist; the checkpoint has " + std::to_string(layers) + " (0 to " +
                std::to_string(layers - 1) + ")");
  }
  d.layer = layer;
  ASSIGN_OR_RETURN(d.rms_norm_eps, Number(j, "rms_norm_eps", 1e-6, where));
  if (static_cast<float>(d.rms_norm_eps) == 0) {  // The norms add it in float32: 0 / 0 there.
    return Fail(where + ": rms_norm_eps is " + nlohmann::json(d.rms_norm_eps).dump() +
                ", which is 0 in float32 (where the norms add it); expected a positive number "
                "float32 holds (from 1.4e-45), such as 1e-6");
  }
  ASSIGN_OR_RETURN(const int64_t max_positions,
                   k.Int("max_position_embeddings", f.max_positions, 1, INT64_MAX));
  ASSIGN_OR_RETURN(RotarySpec rotary, ParseRotary(j, spec.head_size, max_positions, where));
  if (rotary.rotary_dim > spec.head_size) {
    return Fail(where + ": rotary dimensions " + std::to_string(rotary.rotary_dim) +
                " exceed head_dim " + std::to_string(spec.head_size));
  }
  d.rotary = rotary;
  if (f.bias_key) {
    ASSIGN_OR_RETURN(const bool bias, k.Bool("attention_bias", false));
    d.q_bias = d.k_bias = d.v_bias = d.o_bias = bias;
  }
  if (f.qkv_bias) d.q_bias = d.k_bias = d.v_bias = true;
  d.qk_norm = f.qk_norm;
  ASSIGN_OR_RETURN(d.sliding_window, ParseWindow(j, type, layer, layers, where));
  spec.kdim = spec.vdim = spec.embed_dim;
  spec.bias = d.q_bias || d.k_bias || d.v_bias || d.o_bias;
  spec.decoder = d;
  return spec;
}

namespace {

// Where each tensor of the checkpoint lies: model.safetensors.index.json's weight_map, or the
// one safetensors file.
StatusOr<std::map<std::string, std::string>> TensorFiles(const fs::path& dir,
                                                         const std::set<std::string>& names) {
  std::map<std::string, std::string> files;
  const fs::path index = dir / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    ASSIGN_OR_RETURN(const std::string text, ReadFile(index.string(), 64 << 20));
    ASSIGN_OR_RETURN(const nlohmann::json j, ParseStrictJson(text, index.string()));
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      return Fail(index.string() + ": weight_map (an object) is required");
    for (const std::string& name : names) {
      const auto it = j["weight_map"].find(name);
      if (it == j["weight_map"].end()) continue;
      if (!it->is_string())
        return Fail(index.string() + ": weight_map[\"" + name + "\"] must be a file name");
      const fs::path file = it->get<std::string>();
      if (file.has_parent_path() || file.filename() == "..") {
        return Fail(index.string() + ": weight_map[\"" + name + "\"] is '" + file.string() +
                    "'; expected a file name in the checkpoint's directory");
      }
      files[name] = (dir / file).string();
    }
    return files;
  }
  fs::path single = dir / "model.safetensors";
  if (!fs::exists(single, ec)) {
    std::vector<fs::path> found;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      if (it->path().extension() == ".safetensors") found.push_back(it->path());
    }
    if (found.size() != 1) {
      return Fail(
          dir.string() + ": found " + std::to_string(found.size()) +
          " .safetensors files and no model.safetensors.index.json; expected one, or an index");
    }
    single = found[0];
  }
  for (const std::string& name : names) files[name] = single.string();
  return files;
}

// The named tensors, each from the file `files` says holds it.
StatusOr<NamedTensors> ReadTensors(const std::string& dir,
                                   const std::map<std::string, std::string>& files,
                                   const std::set<std::string>& names) {
  std::map<std::string, std::set<std::string>> by_file;
  for (const std::string& name : names) {
    const auto it = files.find(name);
    if (it == files.end()) {
      return Fail(dir + ": the checkpoint's weight map has no '" + name + "'");
    }
    by_file[it->second].insert(name);
  }
  NamedTensors tensors;
  for (const auto& entry :
       by_file) {  // Not a structured binding: clang's C++17 lambdas cannot capture one.
    const std::set<std::string>& wanted = entry.second;
    ASSIGN_OR_RETURN(NamedTensors got,
                     ReadSafetensorsTensors(
                         entry.first, [&](const std::string& n) { return wanted.count(n) > 0; }));
    for (auto& [n, t] : got) tensors.emplace(n, std::move(t));
  }
  return tensors;
}

// q, k and v's biases as one [H*D + 2*KVH*D] (a missing one zeros); nullopt when none has one.
std::optional<HostTensor> InProjBias(const std::vector<std::optional<HostTensor>>& qkv, int64_t wq,
                                     int64_t wkv) {
  if (!qkv[0] && !qkv[1] && !qkv[2]) return std::nullopt;
  HostTensor in;
  in.shape = {wq + 2 * wkv};
  in.values.assign(static_cast<size_t>(wq + 2 * wkv), 0.0f);
  const int64_t offsets[3] = {0, wq, wq + wkv};
  for (int i = 0; i < 3; ++i) {
    if (qkv[i])
      std::copy(qkv[i]->values.begin(), qkv[i]->values.end(), in.values.begin() + offsets[i]);
  }
  return in;
}

}  // namespace

StatusOr<ModelWeights> LoadCheckpointLayer(const std::string& dir_name, int64_t layer) {
  const fs::path dir(dir_name);
  const std::string config_path = (dir / "config.json").string();
  ASSIGN_OR_RETURN(const std::string config_text, ReadFile(config_path, 1 << 20));
  ASSIGN_OR_RETURN(ModelSpec spec, ParseCheckpointConfig(config_text, layer, config_path));
  const DecoderSpec& d = *spec.decoder;
  const int64_t e = spec.embed_dim, dh = spec.head_dim(), wq = spec.q_width(),
                wkv = spec.kv_width();
  const std::string prefix = "model.layers." + std::to_string(layer) + ".self_attn.";
  struct Want {
    std::string name;
    std::vector<int64_t> shape;
    bool required;
  };
  const std::vector<Want> wants = {
      {"q_proj.weight", {wq, e}, true},   {"k_proj.weight", {wkv, e}, true},
      {"v_proj.weight", {wkv, e}, true},  {"o_proj.weight", {e, wq}, true},
      {"q_proj.bias", {wq}, d.q_bias},    {"k_proj.bias", {wkv}, d.k_bias},
      {"v_proj.bias", {wkv}, d.v_bias},   {"o_proj.bias", {e}, d.o_bias},
      {"q_norm.weight", {dh}, d.qk_norm}, {"k_norm.weight", {dh}, d.qk_norm}};
  std::set<std::string> names;
  for (const Want& w : wants) {
    if (w.required) names.insert(prefix + w.name);
  }
  ASSIGN_OR_RETURN(const auto files, TensorFiles(dir, names));
  ASSIGN_OR_RETURN(NamedTensors tensors, ReadTensors(dir_name, files, names));
  ModelWeights w;
  const auto take = [&](const Want& want) -> StatusOr<std::optional<HostTensor>> {
    const std::string name = prefix + want.name;
    const auto it = tensors.find(name);
    if (!want.required) return std::optional<HostTensor>();
    if (it == tensors.end()) {
      return Fail(files.at(name) + ": has no tensor '" + name + "' (" + d.family + " layer " +
                  std::to_string(layer) + " needs it)");
    }
    if (it->second.shape != want.shape) {
      return Fail(files.at(name) + ": '" + name + "' has shape " + ShapeString(it->second.shape) +
                  "; config.json makes it " + ShapeString(want.shape));
    }
    for (float v : it->second.values) {
      if (!std::isfinite(v)) return Fail(files.at(name) + ": '" + name + "' holds NaN or infinity");
    }
    return std::optional<HostTensor>(std::move(it->second));
  };
  std::vector<std::optional<HostTensor>> got;
  for (const Want& want : wants) {
    ASSIGN_OR_RETURN(std::optional<HostTensor> t, take(want));
    got.push_back(std::move(t));
  }
  w.q_proj = std::move(*got[0]);
  w.k_proj = std::move(*got[1]);
  w.v_proj = std::move(*got[2]);
  w.out_proj = std::move(*got[3]);
  w.in_proj_bias = InProjBias({got[4], got[5], got[6]}, wq, wkv);
  if (got[7]) w.out_proj_bias = std::move(got[7]);
  if (got[8]) w.q_norm = std::move(got[8]);
  if (got[9]) w.k_norm = std::move(got[9]);
  spec.source = dir_name;
  w.spec = std::move(spec);
  w.spec.weights_hash = HashWeights(w);
  return w;
}

}  // namespace attnserve
