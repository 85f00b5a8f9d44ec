// The engine alone (Google Benchmark): a set of requests computed one by one with Forward versus
// together with ForwardBatch, for W1-like (self, 8-64) and W2-like (16-512, half cross) sets.
// Same requests, same thread, so the ratio is what batching buys the engine. Each reports FLOP/s
// (projections and attention, as the server's metrics count them: ForwardFlops) beside GemmBound:
// the BLAS alone multiplying the same rows by the same projection matrices (sgemm through the BLAS
// that LibTorch uses, looked up at run time), the ceiling for a batch whose time is all projection
// GEMM.
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <random>

#include "server/engine/attention_model.h"
#include "server/engine/model_loader.h"
#include "server/types.h"
#include "server/validator.h"

namespace {

struct Set {
  double flops = 0;  // per pass over the set
  int64_t self_rows = 0, cross_rows = 0,
          key_rows = 0;            // query rows of self- and cross-attention, key rows
  std::vector<std::string> bytes;  // query, key, value storage
  std::vector<attnserve::AttendCall> calls;
  std::vector<std::string> outs;
  std::vector<attnserve::AttendOutputs> outputs;
};

const attnserve::AttentionModel& Model() {
  static auto* model =
      attnserve::CreateTorchModel(attnserve::DemoModelWeights(), {}).value().release();
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
    return attnserve::TensorView{
        attnserve::DType::kFloat32, {1, l, 512}, s.bytes.back().data(), s.bytes.back().size()};
  };
  for (int i = 0; i < n; ++i) {
    attnserve::AttendCall c;
    const int lq = len(rng);
    c.query = tensor(lq);
    if (std::uniform_real_distribution<double>()(rng) < cross) {
      const int lk = len(rng);
      c.key = tensor(lk);
      c.value = tensor(lk);
      s.key_rows += lk;
    }
    (c.key ? s.cross_rows : s.self_rows) += lq;
    attnserve::Validate(Model().spec(), {}, &c);
    s.flops += attnserve::ForwardFlops(Model().spec(), c);
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
  state.counters["FLOP/s"] =
      benchmark::Counter(s.flops, benchmark::Counter::kIsIterationInvariantRate);
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
  state.counters["FLOP/s"] =
      benchmark::Counter(s.flops, benchmark::Counter::kIsIterationInvariantRate);
}

// The set's projections as plain sgemm calls on one thread: query rows (and, for self-attention,
// key and value rows) by the [E, 3E] or [E, E] input matrices, every query row by the output
// matrix. No attention, no copies: what the projections cost at the BLAS's own speed.
void GemmBound(benchmark::State& state, int lo, int hi, double cross) {
  using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                         float, float*, int);
  const auto sgemm = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  if (!sgemm) {
    state.SkipWithError("LibTorch's BLAS exports no cblas_sgemm in this process");
    return;
  }
  Model();  // Sets the BLAS to one thread per caller, as in the server.
  const Set s = MakeSet(static_cast<int>(state.range(0)), lo, hi, cross, 7);
  const int e = 512;
  const int self_rows = static_cast<int>(s.self_rows), cross_rows = static_cast<int>(s.cross_rows);
  const int key_rows = static_cast<int>(s.key_rows), rows = self_rows + cross_rows + 2 * key_rows;
  std::vector<float> x(static_cast<size_t>(rows) * e, 0.5f);
  std::vector<float> w(static_cast<size_t>(3 * e) * e, 0.25f), y(static_cast<size_t>(rows) * 3 * e);
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  for (auto _ : state) {
    // y = x · w^T as at::linear does: self-attention rows by [3E, E] (q, k, v at once), the
    // cross-attention queries, keys and values each by its [E, E]; then every query row by the
    // output matrix.
    sgemm(kRowMajor, kNoTrans, kTrans, self_rows, 3 * e, e, 1.0f, x.data(), e, w.data(), e, 0.0f,
          y.data(), 3 * e);
    if (cross_rows + key_rows > 0) {
      sgemm(kRowMajor, kNoTrans, kTrans, cross_rows + 2 * key_rows, e, e, 1.0f, x.data(), e,
            w.data(), e, 0.0f, y.data(), e);
    }
    sgemm(kRowMajor, kNoTrans, kNoTrans, self_rows + cross_rows, e, e, 1.0f, x.data(), e, w.data(),
          e, 0.0f, y.data(), e);
  }
  // The FLOPs the engine's passes are credited with, so the two FLOP/s compare directly.
  state.counters["FLOP/s"] =
      benchmark::Counter(s.flops, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK_CAPTURE(OneByOne, W1, 8, 64, 0.0)->Arg(16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(Batched, W1, 8, 64, 0.0)->Arg(16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(OneByOne, W2, 16, 512, 0.5)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(Batched, W2, 16, 512, 0.5)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(GemmBound, W1, 8, 64, 0.0)->Arg(16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(GemmBound, W2, 16, 512, 0.5)->Arg(8)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
