// The JSON tensors' cost on the HTTP port, per number and per body, side by side in one run:
// float32 written as text by std::to_chars' shortest form (what the answers used first), by
// WriteFloat32 one number at a time, and by WriteFloat32List (the answers' path: digits of a block
// computed side by side); a request body as Python clients write it (json.dumps of the values as
// Python floats: 17 significant digits) decoded into the protocol's request, and an answer of
// the same shape encoded. One W1 body: [1, 38, 512] float32 (W1's mean length).
//   build/attnserve_json_bench [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <charconv>
#include <random>
#include <string>
#include <vector>

#include "server/http/float_text.h"
#include "server/http/oip_json.h"

namespace attnserve {
namespace {

constexpr int kLength = 38, kE = 512;

std::vector<float> Values(size_t n) {
  std::mt19937 rng(74);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng) * 0.1f;  // Attention outputs' magnitudes.
  return v;
}

// `write(p, f)` for every number of a W1 answer, each followed by a comma.
template <typename Write>
void OneNumberAtATime(benchmark::State& state, Write write) {
  const std::vector<float> v = Values(kLength * kE);
  std::string out(v.size() * (kFloat32TextMax + 1) + kFloat32Room, '\0');
  for (auto _ : state) {
    char* p = out.data();
    for (float f : v) {
      p = write(p, f);
      *p++ = ',';
    }
    benchmark::DoNotOptimize(p);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(v.size()));
}

void BM_Float32Text_ToCharsShortest(benchmark::State& state) {
  OneNumberAtATime(state,
                   [](char* p, float f) { return std::to_chars(p, p + kFloat32TextMax, f).ptr; });
}

void BM_Float32Text_WriteFloat32(benchmark::State& state) { OneNumberAtATime(state, WriteFloat32); }

void BM_Float32Text_WriteFloat32List(benchmark::State& state) {
  const std::vector<float> v = Values(kLength * kE);
  std::string out(v.size() * (kFloat32TextMax + 1) + kFloat32Room, '\0');
  for (auto _ : state) {
    benchmark::DoNotOptimize(WriteFloat32List(out.data(), v.data(), v.size()));
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(v.size()));
}

void BM_JsonBody_Decode(benchmark::State& state) {
  const std::vector<float> v = Values(kLength * kE);
  std::string body = R"({"inputs":[{"name":"query","datatype":"FP32","shape":[1,)" +
                     std::to_string(kLength) + "," + std::to_string(kE) + R"(],"data":[)";
  for (size_t i = 0; i < v.size(); ++i) {
    char text[32];
    // As Python writes a float32 widened to a double: its shortest double form.
    char* end = std::to_chars(text, text + sizeof text, static_cast<double>(v[i])).ptr;
    body += (i ? "," : "") + std::string(text, end);
  }
  body += "]}]}";
  for (auto _ : state) {
    std::string copy = body;  // The server decodes the body it holds, padded.
    copy.reserve(copy.size() + 64);
    inference::ModelInferRequest request;
    HttpAnswerForm form;
    const Status st =
        HttpInferToOip(&copy, std::nullopt, "demo", "", JsonLimits{}, &request, &form);
    if (!st.ok()) state.SkipWithError(st.message().c_str());
    benchmark::DoNotOptimize(request);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(body.size()));
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(v.size()));
}

void BM_JsonAnswer_Encode(benchmark::State& state) {
  const std::vector<float> v = Values(kLength * kE);
  inference::ModelInferResponse head;
  head.set_model_name("demo");
  head.set_model_version("1");
  auto* o = head.add_outputs();
  o->set_name("attn_output");
  o->set_datatype("FP32");
  for (int64_t d : {int64_t{1}, int64_t{kLength}, int64_t{kE}}) o->add_shape(d);
  for (auto _ : state) {
    std::vector<AnswerBytes> raw(1);
    raw[0].own =
        std::make_unique<std::string>(reinterpret_cast<const char*>(v.data()), v.size() * 4);
    std::string json;
    std::vector<AnswerBytes> tail;
    std::optional<size_t> header;
    OipAnswerToHttp(head, std::move(raw), HttpAnswerForm{}, &json, &tail, &header);
    benchmark::DoNotOptimize(json);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(v.size()));
}

BENCHMARK(BM_Float32Text_ToCharsShortest);
BENCHMARK(BM_Float32Text_WriteFloat32);
BENCHMARK(BM_Float32Text_WriteFloat32List);
BENCHMARK(BM_JsonBody_Decode);
BENCHMARK(BM_JsonAnswer_Encode);

}  // namespace
}  // namespace attnserve

BENCHMARK_MAIN();
