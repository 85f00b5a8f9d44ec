#pragma once
// nn.MultiheadAttention in float64, written in plain loops: the independent reference that engine
// and server tests compare against. No LibTorch and no BLAS, so it cannot share their faults.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "server/weights/model_weights.h"
#include "tests/lib/test_util.h"

namespace attnserve::testing {

using Vec = std::vector<double>;
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// nn.MultiheadAttention in float64, batch-first [B, L, *] inputs, additive mask [B, H, Lq, Lk]
// (+inf-free; -inf = masked; empty: no mask). Returns output [B, Lq, E] and weights [B, H, Lq, S].
// Compiled out of line (mha_reference.cc), at the build type's optimisation: the tests' own code
// compiles at -O0 (ATTNSERVE_TESTS_OPTIMIZATION), where these loops ran ~3x slower under the
// sanitizers.
void Reference(const ModelWeights& w, int64_t b, int64_t lq, int64_t lk, const Vec& q, const Vec& k,
               const Vec& v, const Vec& mask, Vec* out, Vec* weights);

inline HostTensor RandomHost(std::mt19937& rng, std::vector<int64_t> shape, float scale) {
  HostTensor t;
  t.values = testing::RandomFloats(rng, testing::Numel(shape), scale);
  t.shape = std::move(shape);
  return t;
}

// [B, L, F] batch-first values -> the wire layout the case asks for.
inline std::vector<float> ToLayout(const Vec& x, int64_t b, int64_t l, int64_t f, bool seq_first) {
  std::vector<float> out(x.size());
  for (int64_t bb = 0; bb < b; ++bb)
    for (int64_t i = 0; i < l; ++i)
      for (int64_t c = 0; c < f; ++c)
        out[(seq_first ? (i * b + bb) : (bb * l + i)) * f + c] =
            static_cast<float>(x[(bb * l + i) * f + c]);
  return out;
}

/// Random weights for a model (scale 1/sqrt(E), biases 0.5, bias_k/v 1), spec filled.
inline ModelWeights RandomWeights(std::mt19937& rng, const char* name, int64_t e, int64_t h,
                                  bool bias = true, int64_t kdim = 0, int64_t vdim = 0,
                                  bool bias_kv = false, bool zero_attn = false) {
  ModelWeights w;
  w.spec.name = name;
  w.spec.embed_dim = e;
  w.spec.num_heads = h;
  w.spec.kdim = kdim ? kdim : e;
  w.spec.vdim = vdim ? vdim : e;
  w.spec.bias = bias;
  w.spec.add_bias_kv = bias_kv;
  w.spec.add_zero_attn = zero_attn;
  const float ws = 1.0f / std::sqrt(static_cast<float>(e));
  w.q_proj = RandomHost(rng, {e, e}, ws);
  w.k_proj = RandomHost(rng, {e, w.spec.kdim}, ws);
  w.v_proj = RandomHost(rng, {e, w.spec.vdim}, ws);
  w.out_proj = RandomHost(rng, {e, e}, ws);
  if (bias) {
    w.in_proj_bias = RandomHost(rng, {3 * e}, 0.5f);
    w.out_proj_bias = RandomHost(rng, {e}, 0.5f);
  }
  if (bias_kv) {
    w.bias_k = RandomHost(rng, {e}, 1.f);
    w.bias_v = RandomHost(rng, {e}, 1.f);
  }
  return w;
}

/// max |got - want| / max |want| over float32 `got` bytes; infinity when the sizes differ or a
/// value is NaN.
double RelativeError(const std::string& got_bytes, const std::vector<float>& want);

}  // namespace attnserve::testing
