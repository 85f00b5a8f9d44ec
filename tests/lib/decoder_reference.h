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
inline std::vector<double> DecoderReference(const ModelWeights& w, int64_t b, int64_t l,
                                            const std::vector<double>& x,
                                            const std::vector<int64_t>& pos, bool causal,
                                            const std::vector<double>& mask = {}) {
  const ModelSpec& s = w.spec;
  const DecoderSpec& dec = *s.decoder;
  const int64_t e = s.embed_dim, h = s.num_heads, kvh = s.kv_heads(), d = s.head_dim();
  const int64_t wq = h * d, wkv = kvh * d, g = h / kvh;
  const float* bias = w.in_proj_bias ? w.in_proj_bias->values.data() : nullptr;
  auto linear = [&](const HostTensor& wt, const float* bi, int64_t out) {
    std::vector<double> y(b * l * out);
    for (int64_t r = 0; r < b * l; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double acc = bi ? bi[o] : 0.0;
        for (int64_t j = 0; j < e; ++j) acc += x[r * e + j] * wt.values[o * e + j];
        y[r * out + o] = acc;
      }
    return y;
  };
  std::vector<double> q = linear(w.q_proj, bias, wq);
  std::vector<double> k = linear(w.k_proj, bias ? bias + wq : nullptr, wkv);
  std::vector<double> v = linear(w.v_proj, bias ? bias + wq + wkv : nullptr, wkv);
  auto transform = [&](std::vector<double>& t, int64_t heads,
                       const std::optional<HostTensor>& norm) {
    const std::vector<double> inv =
        dec.rotary ? DecoderInverseFrequencies(*dec.rotary) : std::vector<double>();
    const int64_t half = static_cast<int64_t>(inv.size());
    for (int64_t r = 0; r < b * l; ++r)
      for (int64_t hh = 0; hh < heads; ++hh) {
        double* p = &t[(r * heads + hh) * d];
        if (norm) {
          double ms = 0;
          for (int64_t c = 0; c < d; ++c) ms += p[c] * p[c];
          const double scale = 1.0 / std::sqrt(ms / d + dec.rms_norm_eps);
          for (int64_t c = 0; c < d; ++c) p[c] = p[c] * scale * norm->values[c];
        }
        for (int64_t j = 0; j < half; ++j) {
          const double a = static_cast<double>(pos[r]) * inv[j];
          const double x1 = p[j], x2 = p[j + half];
          p[j] = x1 * std::cos(a) - x2 * std::sin(a);
          p[j + half] = x2 * std::cos(a) + x1 * std::sin(a);
        }
      }
  };
  transform(q, h, w.q_norm);
  transform(k, kvh, w.k_norm);
  const double scale = dec.scale > 0 ? dec.scale : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> merged(b * l * wq, 0.0);
  for (int64_t bb = 0; bb < b; ++bb)
    for (int64_t hh = 0; hh < h; ++hh) {
      const int64_t kv = hh / g;
      for (int64_t i = 0; i < l; ++i) {
        std::vector<double> sc(l, -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < l; ++j) {
          if (causal && j > i) continue;
          if (dec.sliding_window > 0 && j <= i - dec.sliding_window) continue;
          double acc = 0;
          for (int64_t c = 0; c < d; ++c)
            acc += q[((bb * l + i) * h + hh) * d + c] * k[((bb * l + j) * kvh + kv) * d + c];
          sc[j] = acc * scale + (mask.empty() ? 0.0 : mask[((bb * h + hh) * l + i) * l + j]);
          mx = std::max(mx, sc[j]);
        }
        if (mx == -INFINITY) continue;  // Every key masked: zeros, as the server answers.
        double sum = 0;
        for (double& z : sc) sum += z = std::exp(z - mx);
        for (int64_t j = 0; j < l; ++j)
          for (int64_t c = 0; c < d; ++c)
            merged[(bb * l + i) * wq + hh * d + c] +=
                sc[j] / sum * v[((bb * l + j) * kvh + kv) * d + c];
      }
    }
  std::vector<double> out(b * l * e);
  for (int64_t r = 0; r < b * l; ++r)
    for (int64_t o = 0; o < e; ++o) {
      double acc = w.out_proj_bias ? w.out_proj_bias->values[o] : 0.0;
      for (int64_t j = 0; j < wq; ++j) acc += merged[r * wq + j] * w.out_proj.values[o * wq + j];
      out[r * e + o] = acc;
    }
  return out;
}

}  // namespace attnserve::testing
