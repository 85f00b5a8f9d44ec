#pragma once
// The attention of one layer of a decoder checkpoint in Hugging Face's layout: a directory holding
// config.json (model_type llama, mistral, qwen2 or qwen3) and the weights as model.safetensors, or
// as shards listed by model.safetensors.index.json. docs/models.md "A layer of a decoder".

#include <cstdint>
#include <string>

#include "server/core/status.h"
#include "server/weights/model_weights.h"

namespace attnserve {

/// What a checkpoint's config.json says about the attention of layer `layer`: embed_dim,
/// num_heads, head_size and the DecoderSpec, each key missing taking its family's default as
/// transformers 5 reads it (Qwen3's head_dim 128, Mistral's 8 key/value heads and 4,096-token
/// window, Qwen2/Qwen3's window only on layers whose layer_types say so). Both generations of
/// RoPE keys load (rope_parameters; rope_theta with rope_scaling). FAILED_PRECONDITION naming
/// `where` and the key for what attnserve does not compute (another family, another RoPE type).
StatusOr<ModelSpec> ParseCheckpointConfig(const std::string& text, int64_t layer,
                                          const std::string& where);

/// Reads layer `layer`'s attention from the checkpoint in `dir`:
/// model.layers.N.self_attn.{q,k,v,o}_proj.weight (and .bias where the family has them),
/// q_norm/k_norm for Qwen3, only those bytes of the files. Shapes and finiteness are checked;
/// spec.weights_hash is set.
StatusOr<ModelWeights> LoadCheckpointLayer(const std::string& dir, int64_t layer);

}  // namespace attnserve
