#pragma once
// A decoder's per-head transforms of its projected queries and keys: RoPE (rotary position
// embeddings, half-split pairs) and q/k RMSNorm, computed as transformers' Llama, Mistral, Qwen2
// and Qwen3 modules compute them (angles and norms in float32). Included only by the engine's
// LibTorch translation units.

#include <ATen/ATen.h>

#include "server/core/types.h"

namespace attnserve {

/// A decoder's per-head transforms: its q/k RMSNorm weights ([D], the compute dtype) and RoPE's
/// inverse frequencies ([rotary_dim / 2], float32), each undefined where it has none (all three
/// for a model that is not a decoder), and the norms' epsilon.
struct DecoderHeads {
  at::Tensor q_norm, k_norm, inv_freq;
  double eps = 0;
};

/// RoPE's inverse frequencies [rotary_dim / 2], float32 on the CPU: theta^(-2j/rotary_dim), then
/// Llama 3's scaling when `r.type` is "llama3".
at::Tensor RotaryInverseFrequencies(const RotarySpec& r);

/// The rotation of `positions` (int64 [rows]): cos and sin of position · inv_freq (float32 angles),
/// [rows, 1, half] each in `dtype`. One table serves every tensor rotated at those positions (a
/// self-attention call's queries and keys).
struct Rotation {
  at::Tensor cos, sin;
};
Rotation RotationAt(const at::Tensor& positions, const at::Tensor& inv_freq, at::ScalarType dtype);

/// Rotates `heads` ([rows, heads, D] in the rotation's dtype, may be a strided view) in place: row
/// i by the rotation's row i, its first 2 * half dimensions as half-split pairs.
void RotateInPlace(const at::Tensor& heads, const Rotation& rotation);

/// RMSNorm over each head's D values of `heads` ([rows, heads, D]) in place: x / sqrt(mean(x²) +
/// eps) in float32, rounded to the heads' dtype, times `weight` ([D]).
void RmsNormHeadsInPlace(const at::Tensor& heads, const at::Tensor& weight, double eps);

/// `heads` ([rows, heads, D]) in place as a decoder's attention takes them: RMS-normed by `norm`
/// when it is defined, then rotated when `rotation` has a table.
void NormRotateInPlace(const at::Tensor& heads, const at::Tensor& norm, double eps,
                       const Rotation& rotation);

}  // namespace attnserve
