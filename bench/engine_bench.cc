// The engine alone (Google Benchmark): a set of requests computed one by one with Forward versus
// together with ForwardBatch, for W1-like (self, 8-64) and W2-like (16-512, half cross) sets.
// Same requests, same thread, so the ratio is what batching buys the engine.
#include <benchmark/benchmark.h>

#include <random>

#include "server/engine/attention_model.h"
#include "server/engine/model_loader.h"
#include "server/validator.h"

namespace {

struct Set {
  std::vector<std::string> bytes;  // query, key, value storage
  std::vector<attnserve::AttendCall> calls;
  std::vector<std::string> outs;
  std::vector<attnserve::AttendOutputs> outputs;
};

const attnserve::AttentionModel& Model() {
  static auto* model = attnserve::CreateTorchModel(attnserve::DemoModelWeights(), {}).value().release();
  return *model;
}

Set MakeSet(int n, int lo, int hi, double cross, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> len(lo, hi);
  std::normal_distribution<float> normal;
  Set s;
  s.bytes.reserve(3 * n);
  auto tensor = [&](int64_t l) {
    std::string b(static_cast<size_t>(l * 512 * 4), '\0');
    float* f = reinterpret_cast<float*>(b.data());
    for (int64_t i = 0; i < l * 512; ++i) f[i] = normal(rng);
    s.bytes.push_back(std::move(b));
    return attnserve::TensorView{attnserve::DType::kFloat32, {1, l, 512}, s.bytes.back().data(),
                                 s.bytes.back().size()};
  };
  for (int i = 0; i < n; ++i) {
    attnserve::AttendCall c;
    c.query = tensor(len(rng));
    if (std::uniform_real_distribution<double>()(rng) < cross) {
      const int lk = len(rng);
      c.key = tensor(lk);
      c.value = tensor(lk);
    }
    attnserve::Validate(Model().spec(), {}, &c);
    s.calls.push_back(c);
  }
  s.outs.resize(n);
  s.outputs.resize(n);
  for (int i = 0; i < n; ++i) s.outputs[i].output = &s.outs[i];
  return s;
}

void OneByOne(benchmark::State& state, int lo, int hi, double cross) {
  Set s = MakeSet(static_cast<int>(state.range(0)), lo, hi, cross, 7);
  for (auto _ : state) {
    for (size_t i = 0; i < s.calls.size(); ++i) Model().Forward(s.calls[i], &s.outputs[i]);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void Batched(benchmark::State& state, int lo, int hi, double cross) {
  Set s = MakeSet(static_cast<int>(state.range(0)), lo, hi, cross, 7);
  std::vector<const attnserve::AttendCall*> calls;
  std::vector<attnserve::AttendOutputs*> outs;
  for (size_t i = 0; i < s.calls.size(); ++i) {
    calls.push_back(&s.calls[i]);
    outs.push_back(&s.outputs[i]);
  }
  for (auto _ : state) Model().ForwardBatch(calls, outs);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

BENCHMARK_CAPTURE(OneByOne, W1, 8, 64, 0.0)->Arg(16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(Batched, W1, 8, 64, 0.0)->Arg(16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(OneByOne, W2, 16, 512, 0.5)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(Batched, W2, 16, 512, 0.5)->Arg(8)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
