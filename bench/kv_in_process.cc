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

InProcessResult InProcessSteps(const std::string& model_dir, const std::vector<int>& prompts,
                               int rounds, int threads, const std::string& device,
                               const std::string& dtype) {
  InProcessResult result;
  StatusOr<ModelWeights> weights = LoadModel(model_dir, "in_process");
  if (!weights.ok()) return {weights.status().ToString()};
  EngineOptions options;
  options.device = device;
  options.compute_dtype = dtype == "bfloat16"  ? DType::kBFloat16
                          : dtype == "float16" ? DType::kFloat16
                                               : DType::kFloat32;
  StatusOr<std::unique_ptr<AttentionModel>> made = CreateTorchModel(*weights, options);
  if (!made.ok()) return {made.status().ToString()};
  const AttentionModel& model = **made;
  result.kernels = model.spec().kernels;
  HelperPool pool(std::max(0, threads - 1));
  std::vector<Session> sessions(prompts.size());
  for (Session& s : sessions) s.cache = model.NewKvCache();
  // Each prompt in chunks of 256 tokens (a 4,096-token prompt at once would pass
  // --max-attention-scores' default in the server).
  constexpr int64_t kChunk = 256;
  for (size_t i = 0; i < sessions.size(); ++i) {
    for (int64_t done = 0; done < prompts[i]; done += kChunk) {
      const int64_t rows = std::min<int64_t>(kChunk, prompts[i] - done);
      const std::vector<std::string> query = {
          Rows(rows, model.spec().embed_dim, 1000 + static_cast<uint32_t>(i * 64 + done))};
      if (!Step(model, {&sessions[i]}, rows, query, pool, &result.error)) return result;
    }
  }
  std::vector<Session*> all;
  for (Session& s : sessions) all.push_back(&s);
  // Every round's queries made before the clock starts.
  std::vector<std::vector<std::string>> queries(static_cast<size_t>(rounds));
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < all.size(); ++i) {
      queries[r].push_back(
          Rows(1, model.spec().embed_dim, 5000 + static_cast<uint32_t>(r * 4096 + i)));
    }
  }
  std::vector<double> ms;
  const auto start = Clock::now();
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = Clock::now();
    if (!Step(model, all, 1, queries[r], pool, &result.error)) return result;
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  result.steps_per_s = static_cast<double>(rounds) * static_cast<double>(all.size()) / wall;
  std::sort(ms.begin(), ms.end());
  result.call_p50_ms = ms.empty() ? 0 : ms[ms.size() / 2];
  return result;
}

}  // namespace attnserve_bench
