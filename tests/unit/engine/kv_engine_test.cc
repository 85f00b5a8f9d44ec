// Keys and values kept between requests, at the engine: T decoding-session steps must give what one
// causal self-attention over the concatenated steps gives, and a request naming a memory what the
// same cross-attention with key and value on the wire gives. The one-call forms are the engine's
// own, which engine_test.cc checks against a float64 reference. Fresh random inputs from fixed
// seeds; tolerance: max |steps - whole| <= 1e-5 * max |whole| (float32), weights 1e-6 absolute.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/models/model_loader.h"
#include "tests/lib/mha_reference.h"
#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

using testing::Buffer;

struct KvCase {
  const char* name;
  bool bias = true, bias_kv = false, zero_attn = false;
  int64_t b = 2;
  bool seq_first = false, unbatched = false;
  bool kpm = false;         // Bool key padding: some keys of batch 0 (session: of some steps).
  bool float_mask = false;  // A float attn_mask on top (causal or not).
  WeightsMode weights = WeightsMode::kNone;
};

std::ostream& operator<<(std::ostream& os, const KvCase& c) { return os << c.name; }

std::unique_ptr<AttentionModel> MakeModel(const KvCase& c, std::mt19937& rng, ModelSpec* spec) {
  ModelWeights w;
  w.spec.name = "kv";
  w.spec.embed_dim = w.spec.kdim = w.spec.vdim = 32;
  w.spec.num_heads = 4;
  w.spec.bias = c.bias;
  w.spec.add_bias_kv = c.bias_kv;
  w.spec.add_zero_attn = c.zero_attn;
  for (HostTensor* t : {&w.q_proj, &w.k_proj, &w.v_proj, &w.out_proj})
    *t = testing::RandomHost(rng, {32, 32}, 0.2f);
  if (c.bias) {
    w.in_proj_bias = testing::RandomHost(rng, {96}, 0.5f);
    w.out_proj_bias = testing::RandomHost(rng, {32}, 0.5f);
  }
  if (c.bias_kv) {
    w.bias_k = testing::RandomHost(rng, {32}, 0.5f);
    w.bias_v = testing::RandomHost(rng, {32}, 0.5f);
  }
  *spec = w.spec;
  auto model = CreateTorchModel(w, EngineOptions{});
  EXPECT_TRUE(model.ok()) << model.status().message();
  return std::move(model).value();
}

// Rows [t0, t0 + t) of a [B, L, E] (or [L, B, E], or [L, E]) float tensor, as a new buffer.
Buffer Rows(const Buffer& x, const KvCase& c, int64_t t0, int64_t t) {
  const float* src = reinterpret_cast<const float*>(x.bytes.data());
  const int64_t e = x.shape.back();
  std::vector<float> out;
  if (c.unbatched || c.seq_first) {  // rows are the outer dimension
    const int64_t row = c.unbatched ? e : c.b * e;
    out.assign(src + t0 * row, src + (t0 + t) * row);
    return testing::Floats(
        c.unbatched ? std::vector<int64_t>{t, e} : std::vector<int64_t>{t, c.b, e}, out);
  }
  const int64_t l = x.shape[1];
  for (int64_t bi = 0; bi < c.b; ++bi)
    out.insert(out.end(), src + (bi * l + t0) * e, src + (bi * l + t0 + t) * e);
  return testing::Floats({c.b, t, e}, out);
}

// Columns [c0, c0 + n) of rows [r0, r0 + m) of a bool or float [R, C] mask, or of each [.., R, C]
// slice.
Buffer Block(const Buffer& m, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const int64_t rows = m.shape[m.shape.size() - 2], cols = m.shape.back();
  const size_t elem = DTypeSize(m.dtype);
  const int64_t slices = testing::Numel(m.shape) / (rows * cols);
  Buffer out{m.dtype, m.shape, {}};
  out.shape[out.shape.size() - 2] = nr;
  out.shape.back() = nc;
  for (int64_t s = 0; s < slices; ++s) {
    for (int64_t r = r0; r < r0 + nr; ++r) {
      out.bytes.append(m.bytes.data() + ((s * rows + r) * cols + c0) * elem, nc * elem);
    }
  }
  return out;
}

// Max |a - b| over float32 bytes, and max |b|.
std::pair<double, double> Compare(const std::string& a, const std::string& b) {
  EXPECT_EQ(a.size(), b.size());
  const float* x = reinterpret_cast<const float*>(a.data());
  const float* y = reinterpret_cast<const float*>(b.data());
  double err = 0, scale = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()) / 4; ++i) {
    err = std::max(err, std::fabs(static_cast<double>(x[i]) - y[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(y[i])));
  }
  return {err, scale};
}

class KvSessionTest : public ::testing::TestWithParam<KvCase> {};

TEST_P(KvSessionTest, StepsEqualOneCausalSelfAttentionOverTheConcatenation) {
  const KvCase c = GetParam();
  std::mt19937 rng(2024);
  ModelSpec spec;
  auto model = MakeModel(c, rng, &spec);
  ASSERT_TRUE(model);
  const int64_t e = 32, h = 4, b = c.unbatched ? 1 : c.b;
  const std::vector<int64_t> steps = {5, 1, 1, 3, 1, 16, 2, 1};  // The first carries a prompt.
  int64_t l = 0;
  for (int64_t t : steps) l += t;
  const std::vector<int64_t> shape = c.unbatched   ? std::vector<int64_t>{l, e}
                                     : c.seq_first ? std::vector<int64_t>{l, b, e}
                                                   : std::vector<int64_t>{b, l, e};
  const Buffer x = testing::Floats(shape, testing::RandomFloats(rng, testing::Numel(shape)));
  Buffer kpm = testing::Zeros(c.unbatched ? std::vector<int64_t>{l} : std::vector<int64_t>{b, l},
                              DType::kBool);
  if (c.kpm) {
    for (int64_t j : {1, 6, 7, 20}) kpm.bytes[j] = 1;  // Keys of batch 0 that are padding.
  }
  Buffer mask = testing::Floats({l, l}, testing::RandomFloats(rng, l * l, 0.5f));

  // The whole sequence in one call.
  AttendCall whole;
  whole.query = x.view();
  whole.is_causal = true;
  whole.weights = c.weights;
  whole.layout = c.seq_first ? TensorLayout::kSequenceFirst : TensorLayout::kBatchFirst;
  if (c.kpm) whole.key_padding_mask = kpm.view();
  if (c.float_mask) whole.attn_mask = mask.view();
  ASSERT_TRUE(Validate(spec, {}, &whole).ok());
  std::string whole_out, whole_w;
  AttendOutputs wo;
  wo.output = &whole_out;
  if (c.weights != WeightsMode::kNone) wo.weights = &whole_w;
  ASSERT_TRUE(model->Forward(whole, &wo).ok());
  const int64_t extra = spec.extra_keys(), s_whole = l + extra;

  // The same tokens as session steps.
  const std::shared_ptr<KvCache> cache = model->NewKvCache();
  ASSERT_TRUE(cache);
  int64_t t0 = 0, capacity = 0;
  std::string steps_out;  // Each step's rows, put back in the whole call's order.
  steps_out.resize(whole_out.size());
  for (int64_t t : steps) {
    const Buffer q = Rows(x, c, t0, t);
    // The step's key padding covers its new tokens: [B, t] (unbatched [t]).
    const Buffer step_kpm =
        c.unbatched ? Buffer{DType::kBool, {t}, kpm.bytes.substr(t0, t)} : Block(kpm, 0, b, t0, t);
    const Buffer step_mask = Block(mask, t0, t, 0, t0 + t);
    AttendCall call;
    call.query = q.view();
    call.is_causal = true;
    call.weights = c.weights;
    call.layout = whole.layout;
    if (c.kpm) call.key_padding_mask = step_kpm.view();
    if (c.float_mask) call.attn_mask = step_mask.view();
    call.kv_use = AttendCall::Kv::kSession;
    call.kv = cache;
    call.kv_batch = b;
    call.kv_length = t0;
    capacity = t0 + t <= capacity ? capacity : std::max<int64_t>({t0 + t, 2 * capacity, 16});
    call.kv_capacity = capacity;
    const Status valid = Validate(spec, {}, &call);
    ASSERT_TRUE(valid.ok()) << valid.message();
    ASSERT_EQ(call.key_len, t0 + t);
    std::string out, wts;
    AttendOutputs o;
    o.output = &out;
    if (c.weights != WeightsMode::kNone) o.weights = &wts;
    const Status st = model->Forward(call, &o);
    ASSERT_TRUE(st.ok()) << st.message();
    // Output rows back into the whole call's layout.
    const float* src = reinterpret_cast<const float*>(out.data());
    float* dst = reinterpret_cast<float*>(steps_out.data());
    if (c.unbatched || c.seq_first) {
      std::memcpy(dst + t0 * b * e, src, out.size());
    } else {
      for (int64_t bi = 0; bi < b; ++bi)
        std::memcpy(dst + (bi * l + t0) * e, src + bi * t * e, t * e * 4);
    }
    if (c.weights != WeightsMode::kNone) {
      // Step weights [B, (H,) t, t0+t+extra] against the whole's rows [t0, t0+t): columns of the
      // keys so far, then the appended keys; the whole's later keys are causally masked (zero).
      const int64_t heads = c.weights == WeightsMode::kPerHead ? h : 1, s_step = t0 + t + extra;
      const float* sw = reinterpret_cast<const float*>(wts.data());
      const float* ww = reinterpret_cast<const float*>(whole_w.data());
      double werr = 0;
      for (int64_t bh = 0; bh < b * heads; ++bh) {
        for (int64_t r = 0; r < t; ++r) {
          for (int64_t j = 0; j < s_whole; ++j) {
            const double want = ww[(bh * l + t0 + r) * s_whole + j];
            const int64_t sj = j < l ? j : t0 + t + (j - l);
            const double have = j < t0 + t || j >= l ? sw[(bh * t + r) * s_step + sj] : 0.0;
            werr = std::max(werr, std::fabs(have - want));
          }
        }
      }
      EXPECT_LE(werr, 1e-6) << "attention weights of the step at " << t0;
    }
    t0 += t;
  }
  const auto [err, scale] = Compare(steps_out, whole_out);
  EXPECT_GT(scale, 0.1);
  EXPECT_LE(err, 1e-5 * scale) << "max |steps - whole| " << err << ", scale " << scale;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KvSessionTest,
    ::testing::Values(KvCase{"Plain"}, KvCase{"NoBias", false}, KvCase{"BiasKv", true, true},
                      KvCase{"ZeroAttn", true, false, true},
                      KvCase{"BiasKvZeroAttn", true, true, true},
                      KvCase{"Batch1", true, false, false, 1},
                      KvCase{"Batch5", true, false, false, 5},
                      KvCase{"SequenceFirst", true, false, false, 3, true},
                      KvCase{"Unbatched", true, false, false, 1, false, true},
                      KvCase{"KeyPadding", true, false, false, 2, false, false, true},
                      KvCase{"FloatMask", true, false, false, 2, false, false, false, true},
                      KvCase{"PerHeadWeights", true, true, true, 2, false, false, true, false,
                             WeightsMode::kPerHead},
                      KvCase{"AveragedWeights", true, false, false, 2, true, false, false, true,
                             WeightsMode::kAveraged}),
    [](const auto& info) { return std::string(info.param.name); });

// Steps of two sessions, a memory query and an ordinary call in one ForwardBatch (their projections
// share the packed GEMMs) give what each gives alone.
TEST(KvBatchTest, SessionStepsAndMemoryQueriesBatchedEqualThemAlone) {
  std::mt19937 rng(5);
  ModelSpec spec;
  auto model = MakeModel(KvCase{"Batched", true, true, false}, rng, &spec);
  ASSERT_TRUE(model);
  const auto floats = [&](std::vector<int64_t> shape) {
    return testing::Floats(shape, testing::RandomFloats(rng, testing::Numel(shape)));
  };
  const Buffer k = floats({2, 10, 32}), v = floats({2, 10, 32});
  AttendCall create;
  create.key = k.view();
  create.value = v.view();
  ASSERT_TRUE(ValidateCreateMemory(spec, {}, &create).ok());
  create.kv = model->NewKvCache();
  std::string none;
  AttendOutputs co;
  co.output = &none;
  ASSERT_TRUE(model->Forward(create, &co).ok());
  // Each session twice: one stepped alone, its twin stepped in batches.
  std::shared_ptr<KvCache> alone[2] = {model->NewKvCache(), model->NewKvCache()};
  std::shared_ptr<KvCache> batched[2] = {model->NewKvCache(), model->NewKvCache()};
  int64_t held[2] = {0, 0}, capacity[2] = {0, 0};
  for (int round = 0; round < 5; ++round) {
    std::vector<Buffer> bufs;
    bufs.reserve(8);
    std::vector<AttendCall> single, together;
    for (int s = 0; s < 2; ++s) {
      const int64_t t = round == 0 ? 3 + s : 1, b = s + 1;
      bufs.push_back(floats({b, t, 32}));
      AttendCall c;
      c.query = bufs.back().view();
      c.is_causal = true;
      c.kv_use = AttendCall::Kv::kSession;
      c.kv_batch = b;
      c.kv_length = held[s];
      capacity[s] = held[s] + t <= capacity[s]
                        ? capacity[s]
                        : std::max<int64_t>({held[s] + t, 2 * capacity[s], 16});
      c.kv_capacity = capacity[s];
      ASSERT_TRUE(Validate(spec, {}, &c).ok());
      c.kv = alone[s];
      single.push_back(c);
      c.kv = batched[s];
      together.push_back(c);
      held[s] += t;
    }
    bufs.push_back(floats({2, 2, 32}));
    AttendCall m;
    m.query = bufs.back().view();
    m.kv_use = AttendCall::Kv::kMemory;
    m.kv = create.kv;
    m.kv_batch = 2;
    m.kv_length = 10;
    ASSERT_TRUE(Validate(spec, {}, &m).ok());
    single.push_back(m);
    together.push_back(m);
    bufs.push_back(floats({1, 4, 32}));
    AttendCall plain;
    plain.query = bufs.back().view();
    ASSERT_TRUE(Validate(spec, {}, &plain).ok());
    single.push_back(plain);
    together.push_back(plain);
    std::vector<std::string> a(single.size()), t(single.size());
    std::vector<AttendOutputs> ao(single.size()), to(single.size());
    std::vector<const AttendCall*> calls;
    std::vector<AttendOutputs*> outs;
    for (size_t i = 0; i < single.size(); ++i) {
      ao[i].output = &a[i];
      ASSERT_TRUE(model->Forward(single[i], &ao[i]).ok());
      to[i].output = &t[i];
      calls.push_back(&together[i]);
      outs.push_back(&to[i]);
    }
    const std::vector<Status> st = model->ForwardBatch(calls, outs);
    for (size_t i = 0; i < single.size(); ++i) {
      ASSERT_TRUE(st[i].ok()) << st[i].message();
      const auto [err, scale] = Compare(t[i], a[i]);
      EXPECT_LE(err, 1e-5 * scale) << "round " << round << ", call " << i;
    }
  }
}

class KvMemoryTest : public ::testing::TestWithParam<KvCase> {};

TEST_P(KvMemoryTest, MemoryEqualsCrossAttentionWithKeyAndValueOnTheWire) {
  const KvCase c = GetParam();
  std::mt19937 rng(77);
  ModelSpec spec;
  auto model = MakeModel(c, rng, &spec);
  ASSERT_TRUE(model);
  const int64_t e = 32, h = 4, b = c.unbatched ? 1 : c.b, lk = 19;
  const TensorLayout layout =
      c.seq_first ? TensorLayout::kSequenceFirst : TensorLayout::kBatchFirst;
  const auto shaped = [&](int64_t len) {
    return c.unbatched   ? std::vector<int64_t>{len, e}
           : c.seq_first ? std::vector<int64_t>{len, b, e}
                         : std::vector<int64_t>{b, len, e};
  };
  const Buffer k = testing::Floats(shaped(lk), testing::RandomFloats(rng, b * lk * e));
  const Buffer v = testing::Floats(shaped(lk), testing::RandomFloats(rng, b * lk * e));
  Buffer kpm = testing::Zeros(c.unbatched ? std::vector<int64_t>{lk} : std::vector<int64_t>{b, lk},
                              DType::kBool);
  for (int64_t j : {0, 3, 4}) kpm.bytes[j] = 1;

  AttendCall create;
  create.key = k.view();
  create.value = v.view();
  create.layout = layout;
  if (c.kpm) create.key_padding_mask = kpm.view();
  ASSERT_TRUE(ValidateCreateMemory(spec, {}, &create).ok());
  ASSERT_EQ(create.batch, b);
  ASSERT_EQ(create.key_len, lk);
  create.kv = model->NewKvCache();
  std::string none;
  AttendOutputs co;
  co.output = &none;
  ASSERT_TRUE(model->Forward(create, &co).ok());

  // Several queries against the memory, batched together with an ordinary call, each equal to the
  // same cross-attention with key and value on the wire.
  std::vector<Buffer> queries;
  for (int64_t lq : {1, 7, 30})
    queries.push_back(testing::Floats(shaped(lq), testing::RandomFloats(rng, b * lq * e)));
  const Buffer mask = testing::Floats({30, lk}, testing::RandomFloats(rng, 30 * lk, 0.5f));
  std::vector<AttendCall> memory_calls(queries.size()), wire_calls(queries.size());
  std::vector<Buffer> masks;
  masks.reserve(queries.size());
  for (size_t i = 0; i < queries.size(); ++i) {
    const int64_t lq = queries[i].shape[c.unbatched || c.seq_first ? 0 : 1];
    masks.push_back(Block(mask, 0, lq, 0, lk));
    for (AttendCall* call : {&memory_calls[i], &wire_calls[i]}) {
      call->query = queries[i].view();
      call->layout = layout;
      call->weights = c.weights;
      call->is_causal = i == 1;
      if (c.float_mask) call->attn_mask = masks[i].view();
    }
    wire_calls[i].key = k.view();
    wire_calls[i].value = v.view();
    if (c.kpm) wire_calls[i].key_padding_mask = kpm.view();
    memory_calls[i].kv_use = AttendCall::Kv::kMemory;
    memory_calls[i].kv = create.kv;
    memory_calls[i].kv_batch = b;
    memory_calls[i].kv_length = lk;
    ASSERT_TRUE(Validate(spec, {}, &wire_calls[i]).ok());
    const Status valid = Validate(spec, {}, &memory_calls[i]);
    ASSERT_TRUE(valid.ok()) << valid.message();
  }
  std::vector<const AttendCall*> batch;
  std::vector<AttendOutputs*> outs;
  std::vector<std::string> got(queries.size()), got_w(queries.size());
  std::vector<AttendOutputs> got_o(queries.size());
  for (size_t i = 0; i < queries.size(); ++i) {
    got_o[i].output = &got[i];
    if (c.weights != WeightsMode::kNone) got_o[i].weights = &got_w[i];
    batch.push_back(&memory_calls[i]);
    outs.push_back(&got_o[i]);
    batch.push_back(&wire_calls[i]);  // Ordinary calls share the batch.
    outs.push_back(new AttendOutputs);
    outs.back()->output = new std::string;
    if (c.weights != WeightsMode::kNone) outs.back()->weights = new std::string;
  }
  const std::vector<Status> statuses = model->ForwardBatch(batch, outs);
  for (size_t i = 0; i < queries.size(); ++i) {
    ASSERT_TRUE(statuses[2 * i].ok()) << statuses[2 * i].message();
    ASSERT_TRUE(statuses[2 * i + 1].ok()) << statuses[2 * i + 1].message();
    const AttendOutputs& wire = *outs[2 * i + 1];
    EXPECT_EQ(memory_calls[i].output_shape, wire_calls[i].output_shape);
    const auto [err, scale] = Compare(got[i], *wire.output);
    EXPECT_GT(scale, 0.1);
    EXPECT_LE(err, 1e-5 * scale) << "query " << i;
    if (c.weights != WeightsMode::kNone) {
      EXPECT_EQ(memory_calls[i].weights_shape, wire_calls[i].weights_shape);
      EXPECT_LE(Compare(got_w[i], *wire.weights).first, 1e-6) << "weights of query " << i;
    }
    delete wire.output;
    delete wire.weights;
    delete outs[2 * i + 1];
  }
  (void)h;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KvMemoryTest,
    ::testing::Values(KvCase{"Plain"}, KvCase{"BiasKvZeroAttn", true, true, true},
                      KvCase{"SequenceFirst", true, false, false, 3, true},
                      KvCase{"Unbatched", true, false, false, 1, false, true},
                      KvCase{"KeyPaddingAndMask", true, false, false, 2, false, false, true, true},
                      KvCase{"PerHeadWeights", true, true, false, 2, false, false, true, false,
                             WeightsMode::kPerHead},
                      KvCase{"AveragedWeights", false, false, true, 2, true, false, false, true,
                             WeightsMode::kAveraged}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace attnserve
