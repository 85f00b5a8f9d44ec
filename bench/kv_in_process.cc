#include "bench/kv_in_process.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>

#include "server/core/types.h"
#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/engine/parallel.h"
#include "server/kv/kv_store.h"
#include "server/models/model_loader.h"

namespace attnserve_bench {
namespace {

using namespace attnserve;  // NOLINT: a benchmark's one unit.
using Clock = std::chrono::steady_clock;

struct Session {
  std::shared_ptr<KvCache> cache;
  int64_t length = 0, capacity = 0;
  std::string output;  // The step's answer.
};

// `rows` standard-normal tokens of width `e`, float32, from `seed`.
std::string Rows(int64_t rows, int64_t e, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::string b(static_cast<size_t>(rows * e) * sizeof(float), '\0');
  auto* f = reinterpret_cast<float*>(b.data());
  for (int64_t i = 0; i < rows * e; ++i) f[i] = normal(rng);
  return b;
}

// One step of `rows` tokens on every session of `on` together, session i's query `queries[i]`
// ([1, rows, E] float32 bytes); false and `error` when it failed.
bool Step(const AttentionModel& model, const std::vector<Session*>& on, int64_t rows,
          const std::vector<std::string>& queries, const Parallel& parallel, std::string* error) {
  const ModelSpec& spec = model.spec();
  std::vector<AttendCall> calls(on.size());
  std::vector<AttendOutputs> outs(on.size());
  std::vector<const AttendCall*> call_ptrs;
  std::vector<AttendOutputs*> out_ptrs;
  for (size_t i = 0; i < on.size(); ++i) {
    Session& s = *on[i];
    AttendCall& c = calls[i];
    c.query = {DType::kFloat32, {1, rows, spec.embed_dim}, queries[i].data(), queries[i].size()};
    c.is_causal = true;
    c.kv_use = AttendCall::Kv::kSession;
    c.kv = s.cache;
    c.kv_batch = 1;
    c.kv_length = s.length;
    const Status st = Validate(spec, AttendLimits(), &c);
    if (!st.ok()) {
      *error = st.ToString();
      return false;
    }
    // The capacity the store would reserve: doubling, as KvStore::GrowCapacity.
    if (s.length + rows > s.capacity)
      s.capacity = KvStore::GrowCapacity(s.capacity, s.length + rows);
    c.kv_capacity = s.capacity;
    outs[i].output = &s.output;
    call_ptrs.push_back(&c);
    out_ptrs.push_back(&outs[i]);
  }
  const std::vector<Status> statuses = model.ForwardBatch(call_ptrs, out_ptrs, parallel);
  for (size_t i = 0; i < on.size(); ++i) {
    if (!statuses[i].ok()) {
      *error = statuses[i].ToString();
      return false;
    }
    on[i]->length += rows;
  }
  return true;
}

}  // namespace

std::string CpuClass() { return EngineCpuClass(); }

struct InProcessStepper::State {
  std::string error, kernels;
  std::unique_ptr<AttentionModel> model;
  std::unique_ptr<HelperPool> pool;
  std::vector<Session> sessions;
  std::vector<Session*> all;
  std::vector<std::vector<std::string>> queries;  // Every round's, made before any clock starts.
  size_t next = 0;                                // The next round's.
};

InProcessStepper::InProcessStepper(const std::string& model_dir, const std::vector<int>& prompts,
                                   int rounds, int threads, const std::string& device,
                                   const std::string& dtype)
    : state_(new State) {
  State& st = *state_;
  StatusOr<ModelWeights> weights = LoadModel(model_dir, "in_process");
  if (!weights.ok()) {
    st.error = weights.status().ToString();
    return;
  }
  EngineOptions options;
  options.device = device;
  options.compute_dtype = dtype == "bfloat16"  ? DType::kBFloat16
                          : dtype == "float16" ? DType::kFloat16
                                               : DType::kFloat32;
  StatusOr<std::unique_ptr<AttentionModel>> made = CreateTorchModel(*weights, options);
  if (!made.ok()) {
    st.error = made.status().ToString();
    return;
  }
  st.model = std::move(made).value();
  const AttentionModel& model = *st.model;
  st.kernels = model.spec().kernels;
  st.pool = std::make_unique<HelperPool>(std::max(0, threads - 1));
  st.sessions.resize(prompts.size());
  for (Session& s : st.sessions) s.cache = model.NewKvCache();
  // Each prompt in chunks of 256 tokens (a 4,096-token prompt at once would pass
  // --max-attention-scores' default in the server).
  constexpr int64_t kChunk = 256;
  for (size_t i = 0; i < st.sessions.size(); ++i) {
    for (int64_t done = 0; done < prompts[i]; done += kChunk) {
      const int64_t rows = std::min<int64_t>(kChunk, prompts[i] - done);
      const std::vector<std::string> query = {
          Rows(rows, model.spec().embed_dim, 1000 + static_cast<uint32_t>(i * 64 + done))};
      if (!Step(model, {&st.sessions[i]}, rows, query, *st.pool, &st.error)) return;
    }
  }
  for (Session& s : st.sessions) st.all.push_back(&s);
  st.queries.resize(static_cast<size_t>(rounds));
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < st.all.size(); ++i) {
      st.queries[r].push_back(
          Rows(1, model.spec().embed_dim, 5000 + static_cast<uint32_t>(r * 4096 + i)));
    }
  }
}

InProcessStepper::~InProcessStepper() { delete state_; }

const std::string& InProcessStepper::error() const { return state_->error; }

const std::string& InProcessStepper::kernels() const { return state_->kernels; }

double InProcessStepper::Rounds(int n, std::vector<double>* ms) {
  State& st = *state_;
  if (!st.error.empty()) return 0;
  if (st.next + static_cast<size_t>(n) > st.queries.size()) {
    st.error = "more rounds than the queries made";
    return 0;
  }
  const auto start = Clock::now();
  for (int r = 0; r < n; ++r) {
    const auto t0 = Clock::now();
    if (!Step(*st.model, st.all, 1, st.queries[st.next++], *st.pool, &st.error)) return 0;
    ms->push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<double>(n) * static_cast<double>(st.all.size()) / wall;
}

}  // namespace attnserve_bench
