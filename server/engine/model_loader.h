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

/// Loads one model directory (see LoadModelDirectory) under `name`.
StatusOr<ModelWeights> LoadModel(const std::string& model_dir, const std::string& name);

/// The built-in `demo` model: embed_dim 512, 8 heads, biases, weights from a fixed-seed generator
/// (identical on every platform and LibTorch version).
ModelWeights DemoModelWeights();

}  // namespace attnserve
