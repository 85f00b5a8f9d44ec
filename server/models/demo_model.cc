#include <cmath>

#include "server/models/model_loader.h"

namespace attnserve {
namespace {

// splitmix64: a tiny, fully specified generator, so the demo weights (and their hash) are the
// same everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-bound, bound).
  float Uniform(float bound) {
    const double u = static_cast<double>(Next() >> 11) * 0x1.0p-53;
    return static_cast<float>((2.0 * u - 1.0) * bound);
  }

 private:
  uint64_t state_;
};

HostTensor Random(SplitMix64& rng, std::vector<int64_t> shape, float bound) {
  HostTensor t;
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  t.shape = std::move(shape);
  t.values.resize(n);
  for (float& v : t.values) v = rng.Uniform(bound);
  return t;
}

}  // namespace

ModelWeights DemoModelWeights() {
  constexpr int64_t kEmbed = 512;
  constexpr int64_t kHeads = 8;
  SplitMix64 rng(20240601);
  ModelWeights w;
  // Xavier-uniform bounds, as nn.MultiheadAttention initialises its projections.
  const float in_bound = std::sqrt(6.0f / (kEmbed + 3 * kEmbed));
  const float out_bound = 1.0f / std::sqrt(static_cast<float>(kEmbed));
  w.q_proj = Random(rng, {kEmbed, kEmbed}, in_bound);
  w.k_proj = Random(rng, {kEmbed, kEmbed}, in_bound);
  w.v_proj = Random(rng, {kEmbed, kEmbed}, in_bound);
  w.in_proj_bias = Random(rng, {3 * kEmbed}, 0.1f);
  w.out_proj = Random(rng, {kEmbed, kEmbed}, out_bound);
  w.out_proj_bias = Random(rng, {kEmbed}, 0.1f);
  ModelSpec& s = w.spec;
  s.name = "demo";
  s.embed_dim = s.kdim = s.vdim = kEmbed;
  s.num_heads = kHeads;
  s.bias = true;
  s.source = "built-in";
  s.weights_hash = HashWeights(w);
  return w;
}

}  // namespace attnserve
