#pragma once

#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/weights/model_weights.h"

namespace attnserve {

/// One version of one model in a model repository, found by ScanModelRepository.
struct ModelSource {
  std::string name;
  int64_t version = 1;
  std::string dir;  ///< The directory holding its config.json.
  /// Changes whenever config.json or any file beside it changes (content of config.json; name, size
  /// and modification time of the others): a reload loads only versions whose fingerprint changed.
  std::string fingerprint;
};

/// What a scan of a model repository found: the versions, and the models whose directory is
/// malformed (each with a message naming the path).
struct RepositoryScan {
  std::vector<ModelSource> sources;                         ///< By name, then version.
  std::vector<std::pair<std::string, std::string>> errors;  ///< (model name, why).
};

/// Lists a model repository (docs/models.md "Models"). Each subdirectory DIR/name/ is a model:
///   DIR/name/config.json + weights        a model with one version, 1 (the original layout), or
///   DIR/name/N/config.json + weights      versions N = 1, 2, ... (positive integers, no leading 0)
/// Subdirectories of DIR/name/ that are not version numbers are ignored (a version being copied in
/// under a temporary name, then renamed into place, is never seen half-written); so are DIR/name/
/// directories with neither layout. FAILED_PRECONDITION when DIR itself cannot be listed.
StatusOr<RepositoryScan> ScanModelRepository(const std::string& dir);

/// Loads every model version under `dir` (ScanModelRepository's layout). config.json:
///   {"num_heads": 8,                    required
///    "weights": "model.safetensors",    the weights file in that directory (.safetensors, or a
///                                       torch.save()'d state_dict: .pt/.pth); default: the only
///                                       such file
///    "add_zero_attn": false}            optional
/// or, for the attention of one layer of a decoder checkpoint (Hugging Face's layout: its own
/// config.json and safetensors; weights/checkpoint.h):
///   {"checkpoint": "../llama", "layer": 3}
/// Any bad model fails the whole load (FAILED_PRECONDITION naming the file): the server does not
/// start half-broken. Each ModelWeights' spec carries its name and version.
/// `scan`, when given, receives the scan the models came from (sources in the same order).
StatusOr<std::vector<ModelWeights>> LoadModelDirectory(const std::string& dir,
                                                       RepositoryScan* scan = nullptr);

/// A model directory's config.json, checked: known keys only, strict JSON, num_heads 1 to 65536.
struct ModelDirConfig {
  ModelConfig config;
  std::string weights;  ///< The weights file named by "weights", or "" to find the only one.
  /// "dynamic_batching": priority levels and queue policies, as Triton's model config names them
  /// (priority_levels, default_priority_level, default_queue_policy, priority_queue_policy); none:
  /// the server's flags.
  std::optional<PriorityOptions> priorities;
  /// A layer of a decoder checkpoint (docs/models.md): its directory, relative to the model's
  /// (or absolute), and which layer; then num_heads, weights and add_zero_attn are not allowed.
  std::string checkpoint;
  int64_t layer = 0;
};

/// Parses config.json text; FAILED_PRECONDITION naming `config_path` and the problem.
StatusOr<ModelDirConfig> ParseModelConfig(const std::string& text, const std::string& config_path);

/// Loads one model directory (see LoadModelDirectory) under `name` and `version`.
StatusOr<ModelWeights> LoadModel(const std::string& model_dir, const std::string& name,
                                 int64_t version = 1);

/// The built-in `demo` model: embed_dim 512, 8 heads, biases, weights from a fixed-seed generator
/// (identical on every platform and LibTorch version).
ModelWeights DemoModelWeights();

}  // namespace attnserve
