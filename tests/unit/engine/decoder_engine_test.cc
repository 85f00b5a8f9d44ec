// A decoder layer's attention (grouped key/value heads, RoPE, sliding window, q/k RMSNorm,
// per-projection biases) in the LibTorch engine against the float64 reference in plain loops
// (tests/lib/decoder_reference.h), prefill and token by token through a session. Fresh weights and
// inputs from a fixed seed per case. Tolerance: max |engine - reference| <= 1e-4 * max |reference|
// (float32 compute; RoPE's angles are float32, as transformers computes them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>

#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/engine/onednn.h"
#include "server/engine/small_attention.h"
#include "tests/lib/decoder_reference.h"
#include "tests/lib/mha_reference.h"
#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

using testing::RandomHost;

struct DecoderCase : testing::DecoderShape {
  int64_t b = 2, l = 7;
  int64_t start = 0;       // query_position
  bool per_token = false;  // positions per token instead
  bool causal = true, seq_first = false, mask3d = false;
};

std::ostream& operator<<(std::ostream& os, const DecoderCase& c) { return os << c.name; }

ModelWeights DecoderWeights(const DecoderCase& c, std::mt19937& rng) {
  return testing::RandomDecoderWeights(rng, c);
}

// max |got - want| / max |want|.
double RelativeError(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return err / scale;
}

// The same over float32 answer bytes in batch-first order.
double RelativeError(const std::string& got, const std::vector<double>& want) {
  const float* g = reinterpret_cast<const float*>(got.data());
  return RelativeError(std::vector<double>(g, g + got.size() / 4), want);
}

class DecoderEngineTest : public ::testing::TestWithParam<DecoderCase> {};

TEST_P(DecoderEngineTest, PrefillMatchesFloat64Reference) {
  const DecoderCase& c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(c.name)));
  const ModelWeights w = DecoderWeights(c, rng);
  auto model = CreateTorchModel(w, EngineOptions{});
  ASSERT_TRUE(model.ok()) << model.status().message();
  const int64_t b = c.b, l = c.l, e = c.e, h = c.h;
  const std::vector<float> xf = testing::RandomFloats(rng, b * l * e);
  const std::vector<double> x(xf.begin(), xf.end());
  std::vector<int64_t> pos(b * l);
  std::uniform_int_distribution<int64_t> jump(0, 50);
  for (int64_t bb = 0; bb < b; ++bb) {
    int64_t p = c.start + bb * 3;
    for (int64_t i = 0; i < l; ++i) {
      pos[bb * l + i] = c.per_token ? p : c.start + i;
      p += 1 + jump(rng) % 3;
    }
  }
  std::vector<double> mask;
  testing::Buffer mask_buf;
  if (c.mask3d) {  // A float mask per (batch, head): grouped heads see their own rows.
    mask.assign(b * h * l * l, 0.0);
    mask_buf = testing::Zeros({b * h, l, l});
    std::uniform_real_distribution<float> u(-2, 2);
    for (size_t i = 0; i < mask.size(); ++i) {
      const float m = u(rng);
      mask[i] = m;
      std::memcpy(&mask_buf.bytes[i * 4], &m, 4);
    }
  }
  const testing::Buffer query =
      testing::Floats(c.seq_first ? std::vector<int64_t>{l, b, e} : std::vector<int64_t>{b, l, e},
                      testing::ToLayout(x, b, l, e, c.seq_first));
  AttendCall call;
  call.query = query.view();
  call.is_causal = c.causal;
  call.layout = c.seq_first ? TensorLayout::kSequenceFirst : TensorLayout::kBatchFirst;
  if (c.mask3d) call.attn_mask = mask_buf.view();
  if (c.per_token) {
    call.positions = pos;
  } else if (c.start != 0) {
    call.query_position = c.start;
  }
  const Status valid = Validate(w.spec, {}, &call);
  ASSERT_TRUE(valid.ok()) << valid.message();
  std::string out;
  AttendOutputs o;
  o.output = &out;
  const Status st = (*model)->Forward(call, &o);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<double> want = testing::DecoderReference(w, b, l, x, pos, c.causal, mask);
  if (c.seq_first) {  // The answer is in the query's layout.
    std::vector<float> laid = testing::ToLayout(want, b, l, e, true);
    want.assign(laid.begin(), laid.end());
  }
  EXPECT_LE(RelativeError(out, want), 1e-4) << c.name;
}

// Token by token through a session (after a prefill of the first tokens) equals the prefill of
// the whole sequence: each step's keys are kept rotated at their positions. The cases a session
// step can be (causal, batch-first, no per-head mask, positions from the start).
class DecoderSessionTest : public DecoderEngineTest {};
class DecoderBatchTest : public DecoderEngineTest {};

TEST_P(DecoderSessionTest, SessionStepsEqualThePrefill) {
  const DecoderCase& c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(c.name)) + 1);
  const ModelWeights w = DecoderWeights(c, rng);
  auto model = CreateTorchModel(w, EngineOptions{});
  ASSERT_TRUE(model.ok()) << model.status().message();
  const int64_t b = c.b, l = c.l, e = c.e;
  const std::vector<float> xf = testing::RandomFloats(rng, b * l * e);
  const std::vector<double> x(xf.begin(), xf.end());
  std::vector<int64_t> pos(b * l);
  for (int64_t i = 0; i < b * l; ++i) pos[i] = c.start + i % l;
  const std::vector<double> want = testing::DecoderReference(w, b, l, x, pos, true);
  std::shared_ptr<KvCache> cache = (*model)->NewKvCache();
  ASSERT_NE(cache, nullptr);
  int64_t held = 0, capacity = 0;
  const int64_t prefill = l / 2;
  std::vector<double> got(b * l * e);
  while (held < l) {
    const int64_t t = held == 0 ? prefill : 1;
    std::vector<float> step(b * t * e);
    for (int64_t bb = 0; bb < b; ++bb)
      std::copy(xf.begin() + (bb * l + held) * e, xf.begin() + (bb * l + held + t) * e,
                step.begin() + bb * t * e);
    const testing::Buffer query = testing::Floats({b, t, e}, step);
    AttendCall call;
    call.query = query.view();
    call.is_causal = true;
    call.kv_use = AttendCall::Kv::kSession;
    call.kv = cache;
    call.kv_batch = b;
    call.kv_length = held;
    capacity = held + t <= capacity ? capacity : std::max<int64_t>({held + t, 2 * capacity, 16});
    call.kv_capacity = capacity;
    if (held == 0 && c.start != 0) call.query_position = c.start;
    if (held > 0 && c.start != 0) call.query_position = c.start + held;
    const Status valid = Validate(w.spec, {}, &call);
    ASSERT_TRUE(valid.ok()) << valid.message();
    std::string out;
    AttendOutputs o;
    o.output = &out;
    const Status st = (*model)->Forward(call, &o);
    ASSERT_TRUE(st.ok()) << st.message();
    const float* f = reinterpret_cast<const float*>(out.data());
    for (int64_t bb = 0; bb < b; ++bb)
      for (int64_t i = 0; i < t * e; ++i) got[(bb * l + held) * e + i] = f[bb * t * e + i];
    held += t;
  }
  EXPECT_LE(RelativeError(got, want), 1e-4) << c.name;
}

DecoderCase Make(const char* name, std::function<void(DecoderCase&)> f) {
  DecoderCase c;
  c.name = name;
  f(c);
  return c;
}

std::vector<DecoderCase> Cases() {
  return {
      Make("rope_mha", [](DecoderCase&) {}),
      Make("gqa_4_to_2", [](DecoderCase& c) { c.h = 4, c.kvh = 2; }),
      Make("gqa_8_to_2_long", [](DecoderCase& c) { c.e = 64, c.h = 8, c.kvh = 2, c.l = 19; }),
      Make("mqa", [](DecoderCase& c) { c.h = 8, c.kvh = 1; }),
      Make("head_dim_not_e_over_h", [](DecoderCase& c) { c.h = 4, c.kvh = 2, c.d = 12; }),
      Make("qkv_biases_no_o",
           [](DecoderCase& c) { c.kvh = 2, c.q_bias = c.k_bias = c.v_bias = true; }),
      Make("all_biases", [](DecoderCase& c) { c.q_bias = c.k_bias = c.v_bias = c.o_bias = true; }),
      Make("partial_rotary", [](DecoderCase& c) { c.kvh = 2, c.rotary_dim = 4; }),
      Make("llama3_scaling",
           [](DecoderCase& c) {
             c.kvh = 2, c.rope_type = "llama3", c.theta = 500000, c.start = 40;
           }),
      Make("sliding_window", [](DecoderCase& c) { c.kvh = 2, c.window = 3, c.l = 11; }),
      Make("window_not_causal", [](DecoderCase& c) { c.window = 4, c.causal = false, c.l = 9; }),
      Make("qk_norm", [](DecoderCase& c) { c.h = 4, c.kvh = 2, c.qk_norm = true; }),
      Make("start_position", [](DecoderCase& c) { c.kvh = 2, c.start = 1000; }),
      Make("per_token_positions", [](DecoderCase& c) { c.kvh = 2, c.per_token = true; }),
      Make("sequence_first", [](DecoderCase& c) { c.kvh = 2, c.seq_first = true; }),
      Make("mask_per_head_grouped", [](DecoderCase& c) { c.h = 4, c.kvh = 2, c.mask3d = true; }),
      Make("no_rotary_not_causal",
           [](DecoderCase& c) { c.kvh = 2, c.rotary = false, c.causal = false; })};
}

std::vector<DecoderCase> SessionCases() {
  std::vector<DecoderCase> out;
  for (const DecoderCase& c : Cases())
    if (c.causal && !c.seq_first && !c.mask3d && !c.per_token) out.push_back(c);
  return out;
}

std::string CaseName(const ::testing::TestParamInfo<DecoderCase>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Decoders, DecoderEngineTest, ::testing::ValuesIn(Cases()), CaseName);
INSTANTIATE_TEST_SUITE_P(Decoders, DecoderSessionTest, ::testing::ValuesIn(SessionCases()),
                         CaseName);
// The models of the session cases (the batch's own calls vary the layout and positions).
INSTANTIATE_TEST_SUITE_P(Decoders, DecoderBatchTest, ::testing::ValuesIn(SessionCases()), CaseName);

// Small calls of one decoder in one ForwardBatch share the projection GEMMs (packed rows), then
// each is normed, rotated and attended on its own rows: every answer equals the float64 reference
// of that call alone. Per model: prefills at different positions and lengths (per-token positions,
// sequence-first where the case allows), cross-attention with key_position on unwindowed models,
// and session steps of several sessions at once.
TEST_P(DecoderBatchTest, SmallCallsPackedInOneBatchEachEqualTheReference) {
  const DecoderCase& c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(c.name)) + 2);
  const ModelWeights w = DecoderWeights(c, rng);
  auto model = CreateTorchModel(w, EngineOptions{});
  ASSERT_TRUE(model.ok()) << model.status().message();
  const int64_t e = c.e, b = 2;
  struct One {
    int64_t l, start;
    bool per_token, seq_first;
    testing::Buffer query;
    std::vector<int64_t> pos;
    std::vector<double> want;
    AttendCall call;
    std::string out;
    AttendOutputs o;
  };
  std::vector<std::unique_ptr<One>> ones;
  for (int n = 0; n < 5; ++n) {
    auto one = std::make_unique<One>();
    One& x = *one;
    x.l = 1 + n * 3, x.start = n * 37, x.per_token = c.rotary && n == 3, x.seq_first = n == 4;
    const std::vector<float> xf = testing::RandomFloats(rng, b * x.l * e);
    const std::vector<double> xd(xf.begin(), xf.end());
    x.pos.resize(b * x.l);
    for (int64_t i = 0; i < b * x.l; ++i)
      x.pos[i] = x.per_token ? static_cast<int64_t>(rng() % 3000) : x.start + i % x.l;
    if (!c.rotary) std::fill(x.pos.begin(), x.pos.end(), 0);
    x.want = testing::DecoderReference(w, b, x.l, xd, x.pos, true);
    if (x.seq_first) {
      const std::vector<float> laid = testing::ToLayout(x.want, b, x.l, e, true);
      x.want.assign(laid.begin(), laid.end());
    }
    x.query = testing::Floats(
        x.seq_first ? std::vector<int64_t>{x.l, b, e} : std::vector<int64_t>{b, x.l, e},
        testing::ToLayout(xd, b, x.l, e, x.seq_first));
    x.call.query = x.query.view();
    x.call.is_causal = true;
    x.call.layout = x.seq_first ? TensorLayout::kSequenceFirst : TensorLayout::kBatchFirst;
    if (x.per_token) {
      x.call.positions = x.pos;
    } else if (c.rotary && x.start != 0) {
      x.call.query_position = x.start;
    }
    const Status valid = Validate(w.spec, {}, &x.call);
    ASSERT_TRUE(valid.ok()) << valid.message();
    x.o.output = &x.out;
    ones.push_back(std::move(one));
  }
  std::vector<const AttendCall*> calls;
  std::vector<AttendOutputs*> outs;
  for (auto& x : ones) calls.push_back(&x->call), outs.push_back(&x->o);
  const std::vector<Status> st = (*model)->ForwardBatch(calls, outs);
  for (size_t i = 0; i < ones.size(); ++i) {
    ASSERT_TRUE(st[i].ok()) << st[i].message();
    EXPECT_LE(RelativeError(ones[i]->out, ones[i]->want), 1e-4) << c.name << " call " << i;
  }

  // Session steps of three sessions in one batch, each a prompt then single tokens: each step's
  // answer equals the rows of the prefill of its whole sequence.
  const int64_t l = 6, sessions = 3;
  std::vector<std::vector<float>> seqs;
  std::vector<std::vector<double>> wants;
  std::vector<std::shared_ptr<KvCache>> caches;
  for (int64_t s = 0; s < sessions; ++s) {
    seqs.push_back(testing::RandomFloats(rng, b * l * e));
    const std::vector<double> xd(seqs.back().begin(), seqs.back().end());
    std::vector<int64_t> pos(b * l);
    for (int64_t i = 0; i < b * l; ++i) pos[i] = c.rotary ? i % l : 0;
    wants.push_back(testing::DecoderReference(w, b, l, xd, pos, true));
    caches.push_back((*model)->NewKvCache());
  }
  int64_t held = 0;
  double worst = 0;
  while (held < l) {
    const int64_t t = held == 0 ? 3 : 1;
    std::vector<testing::Buffer> queries;
    std::vector<AttendCall> step(sessions);
    std::vector<std::string> got(sessions);
    std::vector<AttendOutputs> o(sessions);
    for (int64_t s = 0; s < sessions; ++s) {
      std::vector<float> rows(b * t * e);
      for (int64_t bb = 0; bb < b; ++bb)
        std::copy(seqs[s].begin() + (bb * l + held) * e, seqs[s].begin() + (bb * l + held + t) * e,
                  rows.begin() + bb * t * e);
      queries.push_back(testing::Floats({b, t, e}, rows));
    }
    calls.clear(), outs.clear();
    for (int64_t s = 0; s < sessions; ++s) {
      AttendCall& call = step[s];
      call.query = queries[s].view();
      call.is_causal = true;
      call.kv_use = AttendCall::Kv::kSession;
      call.kv = caches[s];
      call.kv_batch = b;
      call.kv_length = held;
      call.kv_capacity = 16;
      const Status valid = Validate(w.spec, {}, &call);
      ASSERT_TRUE(valid.ok()) << valid.message();
      o[s].output = &got[s];
      calls.push_back(&call), outs.push_back(&o[s]);
    }
    const std::vector<Status> steps = (*model)->ForwardBatch(calls, outs);
    for (int64_t s = 0; s < sessions; ++s) {
      ASSERT_TRUE(steps[s].ok()) << steps[s].message();
      std::vector<double> want(b * t * e);
      for (int64_t bb = 0; bb < b; ++bb)
        for (int64_t i = 0; i < t * e; ++i)
          want[bb * t * e + i] = wants[s][(bb * l + held) * e + i];
      worst = std::max(worst, RelativeError(got[s], want));
    }
    held += t;
  }
  EXPECT_LE(worst, 1e-4) << c.name << ": session steps batched";
}

// The model's kernels label (GetModel, attnserve_model_info) names where a grouped layer's
// decoding steps attend: small_attention's kernels where they run (float32 on AVX2 without
// oneDNN's AVX-512 kernels, and where LibTorch has no fused kernel); a layer with a key/value head
// per query head never says so.
TEST(DecoderEngineTest, KernelsLabelSaysWhereAGroupedLayersStepsAttend) {
  const bool runs = small_attention::Available() && !EngineHasFusedAttention();
  // The kernels run at oneDNN's instruction set (ONEDNN_MAX_CPU_ISA=AVX2 caps them too).
  const bool avx512 =
      small_attention::Best() == small_attention::Isa::kAvx512 && onednn::HasAvx512Kernels();
  const std::string label = avx512 ? "grouped decoding steps on AVX2 and AVX-512 kernels"
                                   : "grouped decoding steps on AVX2 kernels";
  for (const int64_t kvh : {int64_t{1}, int64_t{2}, int64_t{4}}) {
    DecoderCase c;
    c.kvh = kvh;
    std::mt19937 rng(7);
    auto model = CreateTorchModel(DecoderWeights(c, rng), EngineOptions{});
    ASSERT_TRUE(model.ok()) << model.status().message();
    const std::string& kernels = (*model)->spec().kernels;
    const bool says = kernels.find(label) != std::string::npos;
    EXPECT_EQ(says, runs && kvh < c.h) << kvh << " key/value heads: " << kernels;
  }
}

TEST(DecoderEngineTest, PositionsAreRefusedOnAnNnMultiheadAttentionModel) {
  std::mt19937 rng(5);
  ModelWeights w = testing::RandomWeights(rng, "mha", 16, 4);
  const testing::Buffer q = testing::Zeros({1, 3, 16});
  AttendCall call;
  call.query = q.view();
  call.query_position = 4;
  const Status st = Validate(w.spec, {}, &call);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("has no rotary positions"), std::string::npos) << st.message();
}

TEST(DecoderEngineTest, AWindowedModelRefusesCrossAttentionAndOutOfRangePositions) {
  DecoderCase c;
  c.name = "windowed";
  c.window = 4;
  std::mt19937 rng(6);
  const ModelWeights w = DecoderWeights(c, rng);
  const testing::Buffer q = testing::Zeros({1, 3, 32}), k = testing::Zeros({1, 5, 32});
  AttendCall cross;
  cross.query = q.view();
  cross.key = k.view();
  cross.value = k.view();
  Status st = Validate(w.spec, {}, &cross);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("sliding window"), std::string::npos) << st.message();
  for (int64_t bad : {int64_t{-1}, int64_t{1} << 31, INT64_MAX, INT64_MIN}) {
    AttendCall call;
    call.query = q.view();
    call.query_position = bad;
    st = Validate(w.spec, {}, &call);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
  }
  AttendCall near_end;  // In range alone, but its last token would not be.
  near_end.query = q.view();
  near_end.query_position = (int64_t{1} << 31) - 2;
  EXPECT_EQ(Validate(w.spec, {}, &near_end).code(), StatusCode::kInvalidArgument);
  AttendCall at_end;  // Its last token at 2^31 - 1, the last position allowed.
  at_end.query = q.view();
  at_end.query_position = (int64_t{1} << 31) - 3;
  st = Validate(w.spec, {}, &at_end);
  EXPECT_TRUE(st.ok()) << st.message();
  {
    DecoderCase plain;  // Cross-attention's keys (no window): 5 keys, the last at 2^31 - 1.
    const ModelWeights pw = DecoderWeights(plain, rng);
    for (const int64_t first : {(int64_t{1} << 31) - 5, (int64_t{1} << 31) - 4}) {
      AttendCall keys_at_end;
      keys_at_end.query = q.view();
      keys_at_end.key = k.view();
      keys_at_end.value = k.view();
      keys_at_end.key_position = first;
      st = Validate(pw.spec, {}, &keys_at_end);
      EXPECT_EQ(st.ok(), first == (int64_t{1} << 31) - 5) << first << ": " << st.message();
    }
  }
  AttendCall wrong_count;
  wrong_count.query = q.view();
  wrong_count.positions = {0, 1};
  st = Validate(w.spec, {}, &wrong_count);
  EXPECT_NE(st.message().find("expected batch * query_len = 3"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace attnserve
