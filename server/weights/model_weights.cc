#include "server/weights/model_weights.h"

#include <openssl/evp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

namespace attnserve {
namespace {

// State_dict keys of each supported naming, by role.
struct Naming {
  const char* description;
  const char* q_w;
  const char* k_w;
  const char* v_w;
  const char* o_w;
  const char* q_b;
  const char* k_b;
  const char* v_b;
  const char* o_b;
};

constexpr Naming kSeed000 = {"seed 000/002 (W_q, W_k, W_v, W_o)",
                             "W_q.weight",
                             "W_k.weight",
                             "W_v.weight",
                             "W_o.weight",
                             "W_q.bias",
                             "W_k.bias",
                             "W_v.bias",
                             "W_o.bias"};
constexpr Naming kSeed003 = {"seed 003 (query.linear, key.linear, value.linear, output)",
                             "query.linear.weight",
                             "key.linear.weight",
                             "value.linear.weight",
                             "output.weight",
                             "query.linear.bias",
                             "key.linear.bias",
                             "value.linear.bias",
                             "output.bias"};

// Strips one prefix shared by every key, e.g. "multi_head_attention." of a wrapper module.
NamedTensors StripCommonPrefix(const NamedTensors& in) {
  if (in.empty()) return in;
  const std::string& first = in.begin()->first;
  const size_t dot = first.find('.');
  if (dot == std::string::npos) return in;
  const std::string prefix = first.substr(0, dot + 1);
  for (const auto& [k, v] : in) {
    if (k.compare(0, prefix.size(), prefix) != 0 || k.size() == prefix.size()) return in;
  }
  // Do not strip a naming's own first component (e.g. every seed-003 key starts differently anyway,
  // but a lone "out_proj." model would otherwise lose it).
  NamedTensors out;
  for (const auto& [k, v] : in) out.emplace(k.substr(prefix.size()), v);
  if (out.count("weight") || out.count("bias")) return in;
  return out;
}

class Canonicalizer {
 public:
  Canonicalizer(const NamedTensors& t, const std::string& where) : t_(t), where_(where) {}

  bool Has(const std::string& key) const { return t_.count(key) > 0; }

  Status Take(const std::string& key, HostTensor* out) {
    auto it = t_.find(key);
    if (it == t_.end()) return Fail("missing key '" + key + "'");
    used_.insert(key);
    *out = it->second;
    return Status::Ok();
  }

  Status TakeOptional(const std::string& key, std::optional<HostTensor>* out) {
    if (!Has(key)) return Status::Ok();
    out->emplace();
    return Take(key, &**out);
  }

  Status CheckShape(const std::string& key, const HostTensor& t, std::vector<int64_t> want) {
    if (t.shape != want) {
      return Fail("'" + key + "' has shape " + ShapeString(t.shape) + ", expected " +
                  ShapeString(want));
    }
    return Status::Ok();
  }

  Status CheckAllUsed(const char* naming) {
    for (const auto& [k, v] : t_) {
      if (!used_.count(k)) {
        return Fail("unexpected key '" + k + "' for the " + std::string(naming) + " naming");
      }
    }
    return Status::Ok();
  }

  Status Fail(const std::string& what) const {
    return {StatusCode::kFailedPrecondition, where_ + ": " + what};
  }

 private:
  const NamedTensors& t_;
  std::string where_;
  std::set<std::string> used_;
};

// Weight [out, in] of a linear layer: returns `in`, or fails unless rank 2 with out == E.
Status LinearIn(Canonicalizer& c, const std::string& key, const HostTensor& w, int64_t e,
                int64_t* in) {
  if (w.shape.size() != 2 || w.shape[0] != e || w.shape[1] < 1) {
    return c.Fail("'" + key + "' has shape " + ShapeString(w.shape) +
                  ", expected [embed_dim=" + std::to_string(e) + ", in_features]");
  }
  *in = w.shape[1];
  return Status::Ok();
}

Status FromMhaNaming(Canonicalizer& c, ModelWeights* w) {
  RETURN_IF_ERROR(c.Take("out_proj.weight", &w->out_proj));
  const auto& o = w->out_proj.shape;
  if (o.size() != 2 || o[0] != o[1] || o[0] < 1) {
    return c.Fail("'out_proj.weight' has shape " + ShapeString(o) + ", expected [E, E]");
  }
  const int64_t e = o[0];
  int64_t in = 0;
  if (c.Has("in_proj_weight")) {
    HostTensor packed;
    RETURN_IF_ERROR(c.Take("in_proj_weight", &packed));
    RETURN_IF_ERROR(c.CheckShape("in_proj_weight", packed, {3 * e, e}));
    const size_t block = static_cast<size_t>(e * e);
    for (int i = 0; i < 3; ++i) {
      HostTensor& dst = i == 0 ? w->q_proj : i == 1 ? w->k_proj : w->v_proj;
      dst.shape = {e, e};
      dst.values.assign(packed.values.begin() + i * block, packed.values.begin() + (i + 1) * block);
    }
  } else {
    RETURN_IF_ERROR(c.Take("q_proj_weight", &w->q_proj));
    RETURN_IF_ERROR(c.CheckShape("q_proj_weight", w->q_proj, {e, e}));
    RETURN_IF_ERROR(c.Take("k_proj_weight", &w->k_proj));
    RETURN_IF_ERROR(LinearIn(c, "k_proj_weight", w->k_proj, e, &in));
    RETURN_IF_ERROR(c.Take("v_proj_weight", &w->v_proj));
    RETURN_IF_ERROR(LinearIn(c, "v_proj_weight", w->v_proj, e, &in));
  }
  RETURN_IF_ERROR(c.TakeOptional("in_proj_bias", &w->in_proj_bias));
  if (w->in_proj_bias) RETURN_IF_ERROR(c.CheckShape("in_proj_bias", *w->in_proj_bias, {3 * e}));
  RETURN_IF_ERROR(c.TakeOptional("out_proj.bias", &w->out_proj_bias));
  if (w->out_proj_bias) RETURN_IF_ERROR(c.CheckShape("out_proj.bias", *w->out_proj_bias, {e}));
  if (c.Has("bias_k") != c.Has("bias_v")) {
    return c.Fail(std::string("missing key '") + (c.Has("bias_k") ? "bias_v" : "bias_k") +
                  "': bias_k and bias_v come together");
  }
  for (const char* key : {"bias_k", "bias_v"}) {
    auto& dst = key[5] == 'k' ? w->bias_k : w->bias_v;
    RETURN_IF_ERROR(c.TakeOptional(key, &dst));
    if (dst) {
      RETURN_IF_ERROR(c.CheckShape(key, *dst, {1, 1, e}));
      dst->shape = {e};
    }
  }
  return c.CheckAllUsed("nn.MultiheadAttention");
}

Status FromSeparateLinears(Canonicalizer& c, const Naming& n, ModelWeights* w) {
  RETURN_IF_ERROR(c.Take(n.o_w, &w->out_proj));
  const auto& o = w->out_proj.shape;
  if (o.size() != 2 || o[0] != o[1] || o[0] < 1) {
    return c.Fail(std::string("'") + n.o_w + "' has shape " + ShapeString(o) + ", expected [E, E]");
  }
  const int64_t e = o[0];
  int64_t in = 0;
  RETURN_IF_ERROR(c.Take(n.q_w, &w->q_proj));
  RETURN_IF_ERROR(c.CheckShape(n.q_w, w->q_proj, {e, e}));
  RETURN_IF_ERROR(c.Take(n.k_w, &w->k_proj));
  RETURN_IF_ERROR(LinearIn(c, n.k_w, w->k_proj, e, &in));
  RETURN_IF_ERROR(c.Take(n.v_w, &w->v_proj));
  RETURN_IF_ERROR(LinearIn(c, n.v_w, w->v_proj, e, &in));
  // Biases are optional one by one (seed 003's value projection always has one); a model with
  // some gets zeros for the others, which computes exactly the same.
  if (c.Has(n.q_b) || c.Has(n.k_b) || c.Has(n.v_b)) {
    w->in_proj_bias = HostTensor{{3 * e}, std::vector<float>(static_cast<size_t>(3 * e), 0.f)};
    const char* keys[3] = {n.q_b, n.k_b, n.v_b};
    for (int i = 0; i < 3; ++i) {
      if (!c.Has(keys[i])) continue;
      HostTensor b;
      RETURN_IF_ERROR(c.Take(keys[i], &b));
      RETURN_IF_ERROR(c.CheckShape(keys[i], b, {e}));
      std::copy(b.values.begin(), b.values.end(), w->in_proj_bias->values.begin() + i * e);
    }
  }
  RETURN_IF_ERROR(c.TakeOptional(n.o_b, &w->out_proj_bias));
  if (w->out_proj_bias) RETURN_IF_ERROR(c.CheckShape(n.o_b, *w->out_proj_bias, {e}));
  return c.CheckAllUsed(n.description);
}

}  // namespace

StatusOr<ModelWeights> CanonicalizeWeights(const NamedTensors& raw, const ModelConfig& config,
                                           const std::string& where) {
  const NamedTensors tensors = StripCommonPrefix(raw);
  Canonicalizer c(tensors, where);
  ModelWeights w;
  for (const auto& [k, t] : tensors) {
    size_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<size_t>(d);
    if (n != t.values.size()) return c.Fail("'" + k + "' holds a wrong number of values");
    for (size_t i = 0; i < t.values.size(); ++i) {
      if (!std::isfinite(t.values[i])) {
        return c.Fail("'" + k + "' holds " + (std::isnan(t.values[i]) ? "NaN" : "infinity") +
                      " at element " + std::to_string(i) + "; weights must be finite");
      }
    }
  }
  if (c.Has("out_proj.weight")) {
    RETURN_IF_ERROR(FromMhaNaming(c, &w));
  } else if (c.Has(kSeed000.o_w)) {
    RETURN_IF_ERROR(FromSeparateLinears(c, kSeed000, &w));
  } else if (c.Has(kSeed003.o_w)) {
    RETURN_IF_ERROR(FromSeparateLinears(c, kSeed003, &w));
  } else {
    return c.Fail(
        "no output projection found: expected 'out_proj.weight' (nn.MultiheadAttention), "
        "'W_o.weight' (seed 000/002) or 'output.weight' (seed 003)");
  }
  ModelSpec& s = w.spec;
  s.embed_dim = w.out_proj.shape[0];
  s.kdim = w.k_proj.shape[1];
  s.vdim = w.v_proj.shape[1];
  s.num_heads = config.num_heads;
  s.bias = w.in_proj_bias.has_value() || w.out_proj_bias.has_value();
  s.add_bias_kv = w.bias_k.has_value();
  s.add_zero_attn = config.add_zero_attn;
  if (s.num_heads < 1) {
    return Status(StatusCode::kFailedPrecondition,
                  config.source + ": num_heads must be >= 1, got " + std::to_string(s.num_heads));
  }
  if (s.embed_dim % s.num_heads != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  config.source + ": num_heads " + std::to_string(s.num_heads) +
                      " does not divide embed_dim " + std::to_string(s.embed_dim) + " of " + where);
  }
  s.weights_hash = HashWeights(w);
  return w;
}

std::string HashWeights(const ModelWeights& w) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  auto add = [&](const char* name, const HostTensor* t) {
    if (t == nullptr) return;
    EVP_DigestUpdate(ctx, name, std::strlen(name) + 1);
    for (int64_t d : t->shape) EVP_DigestUpdate(ctx, &d, sizeof d);
    EVP_DigestUpdate(ctx, t->values.data(), t->values.size() * sizeof(float));
  };
  add("q_proj", &w.q_proj);
  add("k_proj", &w.k_proj);
  add("v_proj", &w.v_proj);
  add("in_proj_bias", w.in_proj_bias ? &*w.in_proj_bias : nullptr);
  add("out_proj", &w.out_proj);
  add("out_proj_bias", w.out_proj_bias ? &*w.out_proj_bias : nullptr);
  add("bias_k", w.bias_k ? &*w.bias_k : nullptr);
  add("bias_v", w.bias_v ? &*w.bias_v : nullptr);
  const int64_t flags[2] = {w.spec.num_heads, w.spec.add_zero_attn ? 1 : 0};
  EVP_DigestUpdate(ctx, flags, sizeof flags);
  if (w.spec
          .decoder) {  // What a decoder computes beyond its tensors (nothing added for MHA models).
    add("q_norm", w.q_norm ? &*w.q_norm : nullptr);
    add("k_norm", w.k_norm ? &*w.k_norm : nullptr);
    const DecoderSpec& d = *w.spec.decoder;
    const auto exact = [](double v) {  // Every bit of a double, unlike std::to_string's 6 decimals.
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.17g", v);
      return std::string(buf);
    };
    std::string text = "decoder:kv_heads=" + std::to_string(d.num_kv_heads) +
                       ",head_dim=" + std::to_string(w.spec.head_dim()) +
                       ",window=" + std::to_string(d.sliding_window) +
                       ",qk_norm=" + std::to_string(d.qk_norm) + ",eps=" + exact(d.rms_norm_eps) +
                       ",scale=" + exact(d.scale) + ",o_bias=" + std::to_string(d.o_bias);
    if (d.rotary) {
      const RotarySpec& r = *d.rotary;
      text += ",rope=" + r.type + ",theta=" + exact(r.theta) +
              ",dim=" + std::to_string(r.rotary_dim) + ",factor=" + exact(r.factor) +
              ",low=" + exact(r.low_freq_factor) + ",high=" + exact(r.high_freq_factor) +
              ",original=" + std::to_string(r.original_max_position);
    }
    EVP_DigestUpdate(ctx, text.data(), text.size());
  }
  unsigned char digest[32];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, digest, &len);
  EVP_MD_CTX_free(ctx);
  static const char* hex = "0123456789abcdef";
  std::string out = "sha256:";
  for (unsigned int i = 0; i < len; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

}  // namespace attnserve
