// The decoder layer's float64 reference (decoder_reference.h), at the build type's optimisation.
#include "tests/lib/decoder_reference.h"

namespace attnserve::testing {

std::vector<double> DecoderReference(const ModelWeights& w, int64_t b, int64_t l,
                                     const std::vector<double>& x, const std::vector<int64_t>& pos,
                                     bool causal, const std::vector<double>& mask) {
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
