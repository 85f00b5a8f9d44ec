#pragma once

#include <string>
#include <vector>

#include "server/engine/model_weights.h"
#include "server/status.h"

namespace attnserve {

/// Loads every model under `dir`: each subdirectory holding a config.json is one model, named after
/// the subdirectory. config.json:
///   {"num_heads": 8,                    required
///    "weights": "model.safetensors",    the weights file in that directory (.safetensors, or a
///                                       torch.save()'d state_dict: .pt/.pth); default: the only such file
///    "add_zero_attn": false}            optional
/// Any bad model fails the whole load (FAILED_PRECONDITION naming the file): the server does not
/// start half-broken.
StatusOr<std::vector<ModelWeights>> LoadModelDirectory(const std::string& dir);

/// A model directory's config.json, checked: known keys only, strict JSON, num_heads 1 to 65536.
struct ModelDirConfig {
  ModelConfig config;
  std::string weights;  ///< The weights file named by "weights", or "" to find the only one.
};

/// Parses config.json text; FAILED_PRECONDITION naming `config_path` and the problem.
StatusOr<ModelDirConfig> ParseModelConfig(const std::string& text, const std::string& config_path);

/// Loads one model directory (see LoadModelDirectory) under `name`.
StatusOr<ModelWeights> LoadModel(const std::string& model_dir, const std::string& name);

/// The built-in `demo` model: embed_dim 512, 8 heads, biases, weights from a fixed-seed generator
/// (identical on every platform and LibTorch version).
ModelWeights DemoModelWeights();

}  // namespace attnserve
