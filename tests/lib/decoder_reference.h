#pragma once
// A decoder layer's attention (grouped key/value heads, RoPE, sliding window, q/k RMSNorm,
// per-projection biases) in float64, written in plain loops from the formulas transformers'
// Llama/Mistral/Qwen modules compute: the independent reference of the engine's decoder tests. No
// LibTorch and no BLAS.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "server/weights/model_weights.h"
#include "tests/lib/mha_reference.h"

namespace attnserve::testing {

// A decoder layer's shape: what RandomDecoderWeights makes.
struct DecoderShape {
  const char* name = "decoder";
  int64_t e = 32, h = 4, kvh = 4, d = 0;  // d 0: e / h
  bool q_bias = false, k_bias = false, v_bias = false, o_bias = false;
  bool rotary = true;
  int64_t rotary_dim = 0;  // 0: d
  std::string rope_type = "default";
  double theta = 10000;
  int64_t window = 0;
  bool qk_norm = false;
};

// Random weights of a Llama-family layer of that shape (projections 1/sqrt(fan-in), biases 0.5,
// norms 1 +- 0.5), its spec filled as a checkpoint's would be.
inline ModelWeights RandomDecoderWeights(std::mt19937& rng, const DecoderShape& c) {
  ModelWeights w;
  ModelSpec& s = w.spec;
  s.name = c.name;
  s.embed_dim = s.kdim = s.vdim = c.e;
  s.num_heads = c.h;
  s.head_size = c.d > 0 ? c.d : c.e / c.h;
  DecoderSpec dec;
  dec.family = "llama";
  dec.num_kv_heads = c.kvh;
  dec.q_bias = c.q_bias, dec.k_bias = c.k_bias, dec.v_bias = c.v_bias, dec.o_bias = c.o_bias;
  if (c.rotary) {
    RotarySpec r;
    r.theta = c.theta;
    r.rotary_dim = c.rotary_dim > 0 ? c.rotary_dim : s.head_size;
    r.type = c.rope_type;
    if (c.rope_type == "llama3") {
      r.factor = 8, r.low_freq_factor = 1, r.high_freq_factor = 4, r.original_max_position = 64;
    }
    dec.rotary = r;
  }
  dec.sliding_window = c.window;
  dec.qk_norm = c.qk_norm;
  s.decoder = dec;
  s.bias = c.q_bias || c.k_bias || c.v_bias || c.o_bias;
  const int64_t wq = s.q_width(), wkv = s.kv_width();
  const float ws = 1.0f / std::sqrt(static_cast<float>(c.e));
  w.q_proj = RandomHost(rng, {wq, c.e}, ws);
  w.k_proj = RandomHost(rng, {wkv, c.e}, ws);
  w.v_proj = RandomHost(rng, {wkv, c.e}, ws);
  w.out_proj = RandomHost(rng, {c.e, wq}, 1.0f / std::sqrt(static_cast<float>(wq)));
  if (c.q_bias || c.k_bias || c.v_bias) {
    w.in_proj_bias = RandomHost(rng, {wq + 2 * wkv}, 0.5f);
    float* bias = w.in_proj_bias->values.data();
    if (!c.q_bias) std::fill(bias, bias + wq, 0.0f);
    if (!c.k_bias) std::fill(bias + wq, bias + wq + wkv, 0.0f);
    if (!c.v_bias) std::fill(bias + wq + wkv, bias + wq + 2 * wkv, 0.0f);
  }
  if (c.o_bias) w.out_proj_bias = RandomHost(rng, {c.e}, 0.5f);
  if (c.qk_norm) {
    w.q_norm = RandomHost(rng, {s.head_size}, 0.5f);
    w.k_norm = RandomHost(rng, {s.head_size}, 0.5f);
    for (float& x : w.q_norm->values) x += 1.0f;
    for (float& x : w.k_norm->values) x += 1.0f;
  }
  return w;
}

// RoPE's inverse frequencies in float64 (Llama 3's scaling included).
inline std::vector<double> DecoderInverseFrequencies(const RotarySpec& r) {
  std::vector<double> inv;
  for (int64_t j = 0; j < r.rotary_dim; j += 2)
    inv.push_back(1.0 / std::pow(r.theta, static_cast<double>(j) / r.rotary_dim));
  if (r.type != "llama3") return inv;
  const double low_wl = r.original_max_position / r.low_freq_factor;
  const double high_wl = r.original_max_position / r.high_freq_factor;
  for (double& f : inv) {
    const double wl = 2 * M_PI / f;
    if (wl > low_wl) {
      f = f / r.factor;
    } else if (wl >= high_wl) {
      const double smooth = (r.original_max_position / wl - r.low_freq_factor) /
                            (r.high_freq_factor - r.low_freq_factor);
      f = (1 - smooth) * f / r.factor + smooth * f;
    }
  }
  return inv;
}

// Self-attention of x [B, L, E] (batch-first) at positions pos [B, L], causal when `causal`
// (query i sees keys j <= i), the model's window on top; optional additive mask [B, H, L, L]
// (empty: none). Returns [B, L, E].
// Out of line (decoder_reference.cc), at the build type's optimisation, as Reference.
std::vector<double> DecoderReference(const ModelWeights& w, int64_t b, int64_t l,
                                     const std::vector<double>& x, const std::vector<int64_t>& pos,
                                     bool causal, const std::vector<double>& mask = {});

}  // namespace attnserve::testing
