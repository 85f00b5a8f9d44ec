#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"

namespace attnserve {

/// A float32 host tensor, row-major.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

/// Tensors by state_dict key.
using NamedTensors = std::map<std::string, HostTensor>;

/// A model's weights in nn.MultiheadAttention's terms, whatever file or naming they came from.
/// Missing per-projection biases of a model that has some are zeros (exactly equivalent).
struct ModelWeights {
  ModelSpec spec;
  HostTensor q_proj;                        ///< [E, E]
  HostTensor k_proj;                        ///< [E, kdim]
  HostTensor v_proj;                        ///< [E, vdim]
  std::optional<HostTensor> in_proj_bias;   ///< [3E]
  HostTensor out_proj;                      ///< [E, E]
  std::optional<HostTensor> out_proj_bias;  ///< [E]
  std::optional<HostTensor> bias_k;         ///< [E]
  std::optional<HostTensor> bias_v;         ///< [E]
  /// A decoder's (spec.decoder) q/k RMSNorm weights, [head_dim] each. Its projections are
  /// q_proj [H*D, E], k_proj and v_proj [KVH*D, E], out_proj [E, H*D], in_proj_bias [H*D +
  /// 2*KVH*D] (missing ones zero) when any of q, k, v has a bias.
  std::optional<HostTensor> q_norm;
  std::optional<HostTensor> k_norm;
};

/// What the weights cannot tell: read from a model directory's config.json.
struct ModelConfig {
  int64_t num_heads = 0;
  bool add_zero_attn = false;
  std::string source = "config.json";  ///< Where it came from, for messages.
};

/// Maps state_dict tensors in any supported naming (nn.MultiheadAttention, seed 000/002 W_q…W_o,
/// seed 003 query.linear…output) to ModelWeights, checking every shape. One common prefix such as
/// "multi_head_attention." is stripped. Every value must be finite (NaN and infinity are refused,
/// naming the tensor). Fills spec dims, flags and weights_hash; `where` names the file in messages.
StatusOr<ModelWeights> CanonicalizeWeights(const NamedTensors& tensors, const ModelConfig& config,
                                           const std::string& where);

/// "sha256:<hex>" over names, shapes and float32 values of the canonical weights.
std::string HashWeights(const ModelWeights& w);

}  // namespace attnserve
