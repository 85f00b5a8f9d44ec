// The engine alone (Google Benchmark), in float32 (F32) and CPU bfloat16 (BF16): a set of requests
// computed one by one with Forward versus together with ForwardBatch, for W1-like (self, 8-64) and
// W2-like (16-512, half cross) sets, and one long lone request (Lone, [1, 1024, 512]). Same
// requests, same thread, so the ratio is what batching buys the engine. Each reports FLOP/s
// (projections and attention, as the server's metrics count them: ForwardFlops) beside the bare
// product bound of the same rows in the same dtype: ProductBound/F32 multiplies them by the
// projection matrices as the engine does: oneDNN on weights packed once (bfloat16; float32 where
// oneDNN's AVX-512 kernels run), else sgemm (the BLAS LibTorch uses, looked up at run time);
// BlasBound/F32 is sgemm whatever the engine runs. The ceiling for a
// batch whose time is all projection products; the context block names the CPU class (AMX,
// AVX512-BF16 or AVX2 only) and oneDNN's ISA.
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <random>

#include "server/core/types.h"
#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/engine/onednn.h"
#include "server/models/model_loader.h"

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

const attnserve::AttentionModel& Model(bool bf16 = false) {
  static auto* f32 =
      attnserve::CreateTorchModel(attnserve::DemoModelWeights(), {}).value().release();
  static auto* b16 = [] {
    attnserve::EngineOptions o;
    o.compute_dtype = attnserve::DType::kBFloat16;
    return attnserve::CreateTorchModel(attnserve::DemoModelWeights(), o).value().release();
  }();
  return bf16 ? *b16 : *f32;
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

void OneByOne(benchmark::State& state, bool bf16, int lo, int hi, double cross) {
  Set s = MakeSet(static_cast<int>(state.range(0)), lo, hi, cross, 7);
  for (auto _ : state) {
    for (size_t i = 0; i < s.calls.size(); ++i) Model(bf16).Forward(s.calls[i], &s.outputs[i]);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.counters["FLOP/s"] =
      benchmark::Counter(s.flops, benchmark::Counter::kIsIterationInvariantRate);
}

void Batched(benchmark::State& state, bool bf16, int lo, int hi, double cross) {
  Set s = MakeSet(static_cast<int>(state.range(0)), lo, hi, cross, 7);
  std::vector<const attnserve::AttendCall*> calls;
  std::vector<attnserve::AttendOutputs*> outs;
  for (size_t i = 0; i < s.calls.size(); ++i) {
    calls.push_back(&s.calls[i]);
    outs.push_back(&s.outputs[i]);
  }
  for (auto _ : state) Model(bf16).ForwardBatch(calls, outs);
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.counters["FLOP/s"] =
      benchmark::Counter(s.flops, benchmark::Counter::kIsIterationInvariantRate);
}

// The set's projections as bare products on one thread: query rows (and, for self-attention, key
// and value rows) by the [E, 3E] or [E, E] input matrices, every query row by the output matrix.
// No attention, no copies: what the projections cost at the product's own speed. float32: sgemm;
// bfloat16: oneDNN on packed weights.
void Bound(benchmark::State& state, bool bf16, bool blas, int lo, int hi, double cross) {
  Model(bf16);  // Sets the BLAS to one thread per caller, as in the server.
  const Set s = MakeSet(static_cast<int>(state.range(0)), lo, hi, cross, 7);
  const int e = 512;
  const int self_rows = static_cast<int>(s.self_rows), cross_rows = static_cast<int>(s.cross_rows);
  const int key_rows = static_cast<int>(s.key_rows), rows = self_rows + cross_rows + 2 * key_rows;
  std::vector<float> wf(static_cast<size_t>(3 * e) * e, 0.25f);
  std::vector<float> x(static_cast<size_t>(rows) * e, 0.5f), y(static_cast<size_t>(rows) * 3 * e);
  if (bf16 || (!blas && attnserve::onednn::HasAvx512Kernels())) {
    using attnserve::onednn::PackedLinear;
    using attnserve::onednn::Type;
    const Type type = bf16 ? Type::kBFloat16 : Type::kFloat32;
    const auto in = PackedLinear::Make(wf.data(), nullptr, 3 * e, e, type);
    const auto one = PackedLinear::Make(wf.data(), nullptr, e, e, type);
    if (!in || !one) {
      state.SkipWithError("oneDNN packs no kernel of this dtype on this CPU");
      return;
    }
    std::vector<uint16_t> xb(static_cast<size_t>(rows) * e, 0x3f00);  // 0.5 in bfloat16
    std::vector<uint16_t> yb(static_cast<size_t>(rows) * 3 * e);
    void* xp = bf16 ? static_cast<void*>(xb.data()) : x.data();
    void* yp = bf16 ? static_cast<void*>(yb.data()) : y.data();
    for (auto _ : state) {
      in->Run(xp, self_rows, e, yp, type, 3 * e);
      if (cross_rows + key_rows > 0) one->Run(xp, cross_rows + 2 * key_rows, e, yp, type, e);
      one->Run(xp, self_rows + cross_rows, e, y.data(), Type::kFloat32, e);
    }
  } else {
    using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                           int, float, float*, int);
    const auto sgemm = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
    if (!sgemm) {
      state.SkipWithError("LibTorch's BLAS exports no cblas_sgemm in this process");
      return;
    }
    constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
    for (auto _ : state) {
      // y = x · w^T as at::linear does: self-attention rows by [3E, E] (q, k, v at once), the
      // cross-attention queries, keys and values each by its [E, E]; then every query row by the
      // output matrix.
      sgemm(kRowMajor, kNoTrans, kTrans, self_rows, 3 * e, e, 1.0f, x.data(), e, wf.data(), e, 0.0f,
            y.data(), 3 * e);
      if (cross_rows + key_rows > 0) {
        sgemm(kRowMajor, kNoTrans, kTrans, cross_rows + 2 * key_rows, e, e, 1.0f, x.data(), e,
              wf.data(), e, 0.0f, y.data(), e);
      }
      sgemm(kRowMajor, kNoTrans, kNoTrans, self_rows + cross_rows, e, e, 1.0f, x.data(), e,
            wf.data(), e, 0.0f, y.data(), e);
    }
  }
  // The FLOPs the engine's passes are credited with, so the two FLOP/s compare directly.
  state.counters["FLOP/s"] =
      benchmark::Counter(s.flops, benchmark::Counter::kIsIterationInvariantRate);
}

void ProductBound(benchmark::State& state, bool bf16, int lo, int hi, double cross) {
  Bound(state, bf16, false, lo, hi, cross);
}
void BlasBound(benchmark::State& state, bool bf16, int lo, int hi, double cross) {
  Bound(state, bf16, true, lo, hi, cross);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("cpu_class", attnserve::onednn::CpuClass());
  benchmark::AddCustomContext("onednn", attnserve::onednn::Describe());
  // Named Kind/Set/DTYPE (bench/flavours.sh reads the ProductBound ones).
  for (const auto& [dt, bf16] : {std::pair{"F32", false}, std::pair{"BF16", true}}) {
    const std::string d = dt;
    const auto ms = benchmark::kMillisecond;
    benchmark::RegisterBenchmark(("OneByOne/W1/" + d).c_str(), OneByOne, bf16, 8, 64, 0.0)
        ->Arg(16)
        ->Unit(ms);
    benchmark::RegisterBenchmark(("Batched/W1/" + d).c_str(), Batched, bf16, 8, 64, 0.0)
        ->Arg(16)
        ->Unit(ms);
    benchmark::RegisterBenchmark(("ProductBound/W1/" + d).c_str(), ProductBound, bf16, 8, 64, 0.0)
        ->Arg(16)
        ->Unit(ms);
    benchmark::RegisterBenchmark(("OneByOne/W2/" + d).c_str(), OneByOne, bf16, 16, 512, 0.5)
        ->Arg(8)
        ->Unit(ms);
    benchmark::RegisterBenchmark(("Batched/W2/" + d).c_str(), Batched, bf16, 16, 512, 0.5)
        ->Arg(8)
        ->Unit(ms);
    benchmark::RegisterBenchmark(("ProductBound/W2/" + d).c_str(), ProductBound, bf16, 16, 512, 0.5)
        ->Arg(8)
        ->Unit(ms);
    benchmark::RegisterBenchmark(("OneByOne/Lone/" + d).c_str(), OneByOne, bf16, 1024, 1024, 0.0)
        ->Arg(1)
        ->Unit(ms);
    benchmark::RegisterBenchmark(("ProductBound/Lone/" + d).c_str(), ProductBound, bf16, 1024, 1024,
                                 0.0)
        ->Arg(1)
        ->Unit(ms);
  }
  benchmark::RegisterBenchmark("BlasBound/W1/F32", BlasBound, false, 8, 64, 0.0)
      ->Arg(16)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BlasBound/W2/F32", BlasBound, false, 16, 512, 0.5)
      ->Arg(8)
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
