#include "server/models/warmup.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "attnserve/half.h"
#include "server/core/validator.h"

namespace attnserve {
namespace {

// Fixed-seed normal values in `dtype`'s bytes: random enough that no kernel takes a zero shortcut.
std::string RandomBytes(DType dtype, int64_t count, std::mt19937* rng) {
  std::normal_distribution<float> normal;
  std::string bytes(static_cast<size_t>(count) * DTypeSize(dtype), '\0');
  for (int64_t i = 0; i < count; ++i) {
    const float f = normal(*rng);
    if (dtype == DType::kFloat32) {
      std::memcpy(&bytes[static_cast<size_t>(i) * 4], &f, 4);
    } else {
      const uint16_t h = dtype == DType::kBFloat16 ? FloatToBFloat16(f) : FloatToHalf(f);
      std::memcpy(&bytes[static_cast<size_t>(i) * 2], &h, 2);
    }
  }
  return bytes;
}

// One warm-up batch's requests and the bytes they point into.
struct Inputs {
  std::vector<std::string> bytes;  // Never reallocated once views point into it (reserved).
  std::vector<AttendCall> calls;
  std::vector<std::string> answers, weights;
  std::vector<AttendOutputs> outputs;
};

TensorView View(Inputs* in, DType dtype, std::vector<int64_t> shape, std::mt19937* rng) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  in->bytes.push_back(RandomBytes(dtype, count, rng));
  const std::string& b = in->bytes.back();
  return TensorView{dtype, std::move(shape), b.data(), b.size()};
}

Status MakeInputs(const ModelSpec& spec, const WarmupBatch& batch, const AttendLimits& limits,
                  Inputs* in) {
  std::mt19937 rng(static_cast<uint32_t>(batch.query_lens.size() * 131 + batch.cross_key_len));
  const size_t n = batch.query_lens.size() + (batch.cross_key_len > 0 ? 1 : 0);
  // A model whose keys or values are not embed_dim wide attends only across: each request then
  // brings keys of its own length.
  const bool cross_only = spec.kdim != spec.embed_dim || spec.vdim != spec.embed_dim;
  in->bytes.reserve(3 * n);
  for (size_t i = 0; i < n; ++i) {
    AttendCall c;
    const bool self = i < batch.query_lens.size();
    const int64_t lq = self ? batch.query_lens[i] : std::min<int64_t>(16, batch.cross_key_len);
    const int64_t lk = self ? lq : batch.cross_key_len;
    c.query = View(in, batch.wire, {1, lq, spec.embed_dim}, &rng);
    if (!self || cross_only) {
      c.key = View(in, batch.wire, {1, lk, spec.kdim}, &rng);
      c.value = View(in, batch.wire, {1, lk, spec.vdim}, &rng);
    }
    c.is_causal = batch.causal && !c.key;
    c.weights = batch.weights ? WeightsMode::kAveraged : WeightsMode::kNone;
    RETURN_IF_ERROR(Validate(spec, limits, &c));
    in->calls.push_back(std::move(c));
  }
  in->answers.resize(n);
  in->weights.resize(n);
  in->outputs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    in->outputs[i].output = &in->answers[i];
    if (batch.weights) in->outputs[i].weights = &in->weights[i];
  }
  return Status::Ok();
}

}  // namespace

std::vector<WarmupBatch> PlanWarmup(const ModelSpec& spec, const WarmupShapes& shapes) {
  std::vector<WarmupBatch> plan;
  if (!shapes.enabled) return plan;
  // The longest self-attention request the limits allow: its rows, and its scores (heads x rows
  // x (rows + the model's extra keys: bias_k, add_zero_attn)) within the score limit.
  const int64_t per_head = shapes.max_attention_scores / std::max<int64_t>(1, spec.num_heads);
  auto score_rows =
      static_cast<int64_t>(std::sqrt(static_cast<double>(std::max<int64_t>(per_head, 1))));
  const int64_t extra = spec.extra_keys();
  while (score_rows > 1 && score_rows > per_head / (score_rows + extra)) --score_rows;
  while (score_rows + 1 <= per_head / (score_rows + 1 + extra)) ++score_rows;
  const int64_t cap = std::max<int64_t>(1, std::min(shapes.max_request_tokens, score_rows));
  const auto fit = [cap](int64_t rows) { return std::clamp<int64_t>(rows, 1, cap); };
  std::vector<DType> wires = {DType::kFloat32};
  if (spec.compute_dtype != DType::kFloat32) wires.push_back(spec.compute_dtype);
  for (DType wire : wires) {
    // A decoding step's one row, then lone requests of each size class.
    std::set<int64_t> lone = {1, fit(128), fit(shapes.shared_request_tokens),
                              fit(shapes.lone_tokens)};
    for (int64_t rows : lone) plan.push_back({wire, {rows}});
    plan.push_back({wire, {fit(64)}, 0, /*causal=*/true});
    plan.push_back({wire, {fit(16)}, 0, false, /*weights=*/true});
    // Small requests packed together (self- and cross-attention, one causal run). A decoder with a
    // sliding window takes no cross-attention (validator.cc).
    const bool cross = !(spec.decoder && spec.decoder->sliding_window > 0);
    plan.push_back({wire, {fit(8), fit(16), fit(32), fit(64)}, cross ? fit(24) : 0});
    plan.push_back({wire, {fit(8), fit(24)}, 0, /*causal=*/true});
    // A batch at the budget, of requests as large as share one.
    const int64_t per = fit(std::min(std::max<int64_t>(shapes.shared_request_tokens, 1),
                                     std::max<int64_t>(shapes.batch_tokens / 4, 1)));
    const int64_t count = std::clamp<int64_t>(shapes.batch_tokens / per, 2, 16);
    plan.push_back({wire, std::vector<int64_t>(static_cast<size_t>(count), per)});
  }
  return plan;
}

Status WarmModel(const std::shared_ptr<const AttentionModel>& model, const WarmupShapes& shapes,
                 const WarmRunner& run) {
  const ModelSpec& spec = model->spec();
  AttendLimits limits;
  limits.max_tokens = std::max<int64_t>(limits.max_tokens, shapes.max_request_tokens);
  limits.max_attention_scores = shapes.max_attention_scores;
  for (const WarmupBatch& batch : PlanWarmup(spec, shapes)) {
    Inputs in;
    const Status made = MakeInputs(spec, batch, limits, &in);
    if (!made.ok()) return Status(made.code(), "warm-up: " + made.message());
    std::vector<const AttendCall*> calls;
    std::vector<AttendOutputs*> outs;
    for (size_t i = 0; i < in.calls.size(); ++i) {
      calls.push_back(&in.calls[i]);
      outs.push_back(&in.outputs[i]);
    }
    for (const Status& st : run ? run(model, calls, outs) : model->ForwardBatch(calls, outs)) {
      if (!st.ok()) return Status(st.code(), "warm-up of " + spec.name + ": " + st.message());
    }
  }
  return Status::Ok();
}

}  // namespace attnserve
