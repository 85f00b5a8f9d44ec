// nn.MultiheadAttention's float64 reference (mha_reference.h), compiled at the build type's
// optimisation.
#include "tests/lib/mha_reference.h"

namespace attnserve::testing {

void Reference(const ModelWeights& w, int64_t b, int64_t lq, int64_t lk, const Vec& q, const Vec& k,
               const Vec& v, const Vec& mask, Vec* out, Vec* weights) {
  const ModelSpec& s = w.spec;
  const int64_t e = s.embed_dim, h = s.num_heads, d = e / h;
  const int64_t extra = s.extra_keys(), sl = lk + extra;
  auto linear = [&](const Vec& x, int64_t rows, int64_t in, const HostTensor& wt,
                    const float* bias) {
    Vec y(rows * e);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < e; ++o) {
        double acc = bias ? bias[o] : 0.0;
        for (int64_t j = 0; j < in; ++j) acc += x[r * in + j] * wt.values[o * in + j];
        y[r * e + o] = acc;
      }
    return y;
  };
  const float* bi = w.in_proj_bias ? w.in_proj_bias->values.data() : nullptr;
  Vec qp = linear(q, b * lq, e, w.q_proj, bi);
  Vec kp = linear(k, b * lk, s.kdim, w.k_proj, bi ? bi + e : nullptr);
  Vec vp = linear(v, b * lk, s.vdim, w.v_proj, bi ? bi + 2 * e : nullptr);
  // Keys/values with bias_k/v and the zero row appended: [B, S, E].
  Vec ks(b * sl * e, 0.0), vs(b * sl * e, 0.0);
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t j = 0; j < lk; ++j)
      for (int64_t c = 0; c < e; ++c) {
        ks[(bb * sl + j) * e + c] = kp[(bb * lk + j) * e + c];
        vs[(bb * sl + j) * e + c] = vp[(bb * lk + j) * e + c];
      }
    if (s.add_bias_kv)
      for (int64_t c = 0; c < e; ++c) {
        ks[(bb * sl + lk) * e + c] = w.bias_k->values[c];
        vs[(bb * sl + lk) * e + c] = w.bias_v->values[c];
      }
  }
  Vec attn(b * lq * e, 0.0);
  weights->assign(b * h * lq * sl, 0.0);
  std::vector<bool> dead_everywhere(b * lq, true);
  for (int64_t bb = 0; bb < b; ++bb)
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t i = 0; i < lq; ++i) {
        Vec sc(sl);
        double mx = -kInf;
        for (int64_t j = 0; j < sl; ++j) {
          double acc = 0;
          for (int64_t c = 0; c < d; ++c)
            acc += qp[(bb * lq + i) * e + hh * d + c] * ks[(bb * sl + j) * e + hh * d + c];
          acc /= std::sqrt(static_cast<double>(d));
          if (j < lk && !mask.empty()) acc += mask[((bb * h + hh) * lq + i) * lk + j];
          sc[j] = acc;
          mx = std::max(mx, acc);
        }
        if (mx == -kInf) continue;  // Every key masked: weights stay 0.
        dead_everywhere[bb * lq + i] = false;
        double z = 0;
        for (double& x : sc) z += (x = std::exp(x - mx));
        for (int64_t j = 0; j < sl; ++j) {
          const double p = sc[j] / z;
          (*weights)[((bb * h + hh) * lq + i) * sl + j] = p;
          for (int64_t c = 0; c < d; ++c)
            attn[(bb * lq + i) * e + hh * d + c] += p * vs[(bb * sl + j) * e + hh * d + c];
        }
      }
  *out = linear(attn, b * lq, e, w.out_proj,
                w.out_proj_bias ? w.out_proj_bias->values.data() : nullptr);
  for (int64_t r = 0; r < b * lq; ++r)
    if (dead_everywhere[r])
      for (int64_t c = 0; c < e; ++c) (*out)[r * e + c] = 0;
}

double RelativeError(const std::string& got_bytes, const std::vector<float>& want) {
  if (got_bytes.size() != want.size() * sizeof(float))
    return std::numeric_limits<double>::infinity();
  const float* got = reinterpret_cast<const float*>(got_bytes.data());
  double scale = 0, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) return std::numeric_limits<double>::infinity();
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  return scale > 0 ? err / scale : err;
}

}  // namespace attnserve::testing
