// The warm-up's plan (which shapes, on which wires) and its run over a model that records what it
// was asked to compute, or refuses.
#include "server/models/warmup.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "server/models/model_loader.h"

namespace attnserve {
namespace {

ModelSpec Spec(DType compute) {
  ModelSpec s;
  s.name = "m";
  s.embed_dim = 64;
  s.num_heads = 4;
  s.kdim = 48;
  s.vdim = 40;
  s.compute_dtype = compute;
  return s;
}

// Records every batch it computes; fails the `fail_at`-th (0 = never). Writes each answer's bytes.
class RecordingModel final : public AttentionModel {
 public:
  explicit RecordingModel(ModelSpec spec, int fail_at = 0)
      : spec_(std::move(spec)), fail_at_(fail_at) {}
  const ModelSpec& spec() const override { return spec_; }
  Status Forward(const AttendCall& call, AttendOutputs* out) const override {
    out->output->assign(static_cast<size_t>(call.output_bytes), '\1');
    if (out->weights) out->weights->assign(static_cast<size_t>(call.weights_bytes), '\1');
    return Status::Ok();
  }
  std::vector<Status> ForwardBatch(const std::vector<const AttendCall*>& calls,
                                   const std::vector<AttendOutputs*>& outs,
                                   const Parallel&) const override {
    std::lock_guard<std::mutex> lock(mu_);
    batches.push_back({});
    for (const AttendCall* c : calls) batches.back().push_back(*c);
    if (fail_at_ > 0 && static_cast<int>(batches.size()) == fail_at_)
      return std::vector<Status>(calls.size(), Internal("engine: no kernel"));
    std::vector<Status> statuses;
    for (size_t i = 0; i < calls.size(); ++i) statuses.push_back(Forward(*calls[i], outs[i]));
    return statuses;
  }
  mutable std::vector<std::vector<AttendCall>> batches;

 private:
  ModelSpec spec_;
  int fail_at_;
  mutable std::mutex mu_;
};

TEST(WarmupTest, PlanCoversEveryWireSizeClassAndPath) {
  WarmupShapes shapes;  // The CPU's batcher defaults: 1024-token batches, 256 shared.
  const std::vector<WarmupBatch> f32 = PlanWarmup(Spec(DType::kFloat32), shapes);
  const std::vector<WarmupBatch> b16 = PlanWarmup(Spec(DType::kBFloat16), shapes);
  ASSERT_FALSE(f32.empty());
  EXPECT_EQ(b16.size(), 2 * f32.size());  // float32 wire, then the model's own bfloat16 wire.
  std::set<DType> wires;
  for (const WarmupBatch& b : b16) wires.insert(b.wire);
  EXPECT_EQ(wires, (std::set<DType>{DType::kFloat32, DType::kBFloat16}));
  std::set<int64_t> lone;
  bool causal = false, weights = false, cross = false, packed = false;
  int64_t budget_rows = 0;
  for (const WarmupBatch& b : f32) {
    if (b.query_lens.size() == 1 && !b.causal && !b.weights && b.cross_key_len == 0)
      lone.insert(b.query_lens[0]);
    causal = causal || b.causal;
    weights = weights || b.weights;
    cross = cross || b.cross_key_len > 0;
    packed = packed || b.query_lens.size() >= 4;
    int64_t rows = 0;
    for (int64_t l : b.query_lens) rows += l;
    budget_rows = std::max(budget_rows, rows);
  }
  EXPECT_EQ(lone, (std::set<int64_t>{1, 128, 256, 512}));  // A decoding step, the size classes.
  EXPECT_TRUE(causal && weights && cross && packed);
  EXPECT_EQ(budget_rows, 1024);  // One batch fills the token budget.
}

TEST(WarmupTest, PlanFollowsTheBudgetsAndNeverExceedsTheRequestLimit) {
  WarmupShapes gpu;
  gpu.batch_tokens = 16384;
  gpu.shared_request_tokens = 16384;
  gpu.max_request_tokens = 1000;
  for (const WarmupBatch& b : PlanWarmup(Spec(DType::kFloat16), gpu)) {
    for (int64_t l : b.query_lens) EXPECT_LE(l, 1000);
    EXPECT_LE(b.cross_key_len, 1000);
  }
  EXPECT_TRUE(PlanWarmup(Spec(DType::kFloat32), WarmupShapes::Off()).empty());
}

TEST(WarmupTest, WarmModelComputesEveryPlannedBatchAsValidatedCalls) {
  auto shared = std::make_shared<RecordingModel>(Spec(DType::kBFloat16));
  RecordingModel& model = *shared;
  WarmupShapes shapes;
  ASSERT_TRUE(WarmModel(shared, shapes).ok());
  const std::vector<WarmupBatch> plan = PlanWarmup(model.spec(), shapes);
  ASSERT_EQ(model.batches.size(), plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    const size_t want = plan[i].query_lens.size() + (plan[i].cross_key_len > 0 ? 1 : 0);
    ASSERT_EQ(model.batches[i].size(), want) << "batch " << i;
    for (const AttendCall& c : model.batches[i]) {
      EXPECT_EQ(c.query.dtype, plan[i].wire);
      EXPECT_GT(c.tokens, 0);  // Validated: the derived fields are filled.
      EXPECT_EQ(c.weights != WeightsMode::kNone, plan[i].weights);
      if (c.key) EXPECT_EQ(c.key->shape[2], 48);  // kdim
    }
  }
}

// On a GPU the batcher's budgets are device-sized (16,384-token batches, requests that large
// shared): a lone request of that many rows would be over --max-attention-scores, and the server
// refused to start (found on an H200, 2026-11-28). The warm-up warms only what a client may send.
TEST(WarmupTest, EveryWarmUpRequestPassesTheServersScoreLimit) {
  ModelSpec spec = Spec(DType::kBFloat16);
  spec.embed_dim = 1024;
  spec.num_heads = 16;
  spec.kdim = spec.vdim = 1024;
  WarmupShapes gpu;
  gpu.batch_tokens = 16384;
  gpu.shared_request_tokens = 16384;
  for (const int64_t limit : {int64_t{1} << 28, int64_t{1} << 20}) {
    gpu.max_attention_scores = limit;
    auto shared = std::make_shared<RecordingModel>(spec);
    const Status st = WarmModel(shared, gpu);
    ASSERT_TRUE(st.ok()) << "limit " << limit << ": " << st.ToString();
    int64_t longest = 0;
    for (const WarmupBatch& b : PlanWarmup(spec, gpu)) {
      for (int64_t l : b.query_lens) {
        EXPECT_LE(spec.num_heads * l * l, limit);
        longest = std::max(longest, l);
      }
    }
    EXPECT_EQ(longest, limit == int64_t{1} << 28 ? 4096 : 256);  // The longest that passes.
  }
  // A model with extra keys (bias_k and bias_v, add_zero_attn) attends over two more.
  spec.add_bias_kv = spec.add_zero_attn = true;
  gpu.max_attention_scores = int64_t{1} << 28;
  const Status st = WarmModel(std::make_shared<RecordingModel>(spec), gpu);
  EXPECT_TRUE(st.ok()) << st.ToString();
}

TEST(WarmupTest, AFailedWarmUpNamesTheModelAndStops) {
  auto shared = std::make_shared<RecordingModel>(Spec(DType::kFloat32), /*fail_at=*/2);
  RecordingModel& model = *shared;
  const Status st = WarmModel(shared, WarmupShapes());
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("warm-up of m"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("no kernel"), std::string::npos) << st.message();
  EXPECT_EQ(model.batches.size(), 2u);
}

TEST(WarmupTest, TheRealEngineWarmsTheDemoModel) {
  auto model = CreateTorchModel(DemoModelWeights(), EngineOptions());
  ASSERT_TRUE(model.ok());
  EXPECT_TRUE(
      WarmModel(std::shared_ptr<const AttentionModel>(std::move(*model)), WarmupShapes()).ok());
}

}  // namespace
}  // namespace attnserve
