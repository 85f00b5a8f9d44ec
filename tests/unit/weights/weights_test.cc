// Weight loading: every naming, every format the C++ side can write, every refusal.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "server/models/model_loader.h"
#include "server/weights/safetensors.h"
#include "tests/lib/safetensors_writer.h"
#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using Entry = testing::TensorEntry;

std::string Safetensors(const std::vector<Entry>& entries) {
  return testing::SafetensorsBytes(entries);
}

Entry Rand(std::mt19937& rng, std::string name, std::vector<int64_t> shape) {
  return {std::move(name), shape, testing::RandomFloats(rng, testing::Numel(shape))};
}

std::vector<Entry> MhaEntries(int64_t e, bool bias = true, bool bias_kv = false) {
  std::mt19937 rng(7);
  std::vector<Entry> v = {Rand(rng, "in_proj_weight", {3 * e, e}),
                          Rand(rng, "out_proj.weight", {e, e})};
  if (bias) {
    v.push_back(Rand(rng, "in_proj_bias", {3 * e}));
    v.push_back(Rand(rng, "out_proj.bias", {e}));
  }
  if (bias_kv) {
    v.push_back(Rand(rng, "bias_k", {1, 1, e}));
    v.push_back(Rand(rng, "bias_v", {1, 1, e}));
  }
  return v;
}

class WeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("attnserve-weights-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // Writes root/<name>/{config.json, file} and returns the model dir.
  std::string Write(const std::string& name, const std::string& bytes,
                    const std::string& config = R"({"num_heads": 4})",
                    const std::string& file = "model.safetensors") {
    const fs::path dir = root_ / name;
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << config;
    std::ofstream(dir / file, std::ios::binary) << bytes;
    return dir.string();
  }

  Status LoadError(const std::string& bytes, const std::string& config = R"({"num_heads": 4})",
                   const std::string& file = "model.safetensors") {
    auto r = LoadModel(Write("bad", bytes, config, file), "bad");
    EXPECT_FALSE(r.ok());
    return r.ok() ? Status() : r.status();
  }

  fs::path root_;
};

TEST_F(WeightsTest, LoadsPackedMultiheadAttention) {
  auto r = LoadModel(Write("mha", Safetensors(MhaEntries(16))), "mha");
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelSpec& s = r->spec;
  EXPECT_EQ(s.name, "mha");
  EXPECT_EQ(s.embed_dim, 16);
  EXPECT_EQ(s.num_heads, 4);
  EXPECT_EQ(s.kdim, 16);
  EXPECT_TRUE(s.bias);
  EXPECT_FALSE(s.add_bias_kv);
  EXPECT_THAT(s.weights_hash, HasSubstr("sha256:"));
  const std::vector<float> packed = MhaEntries(16)[0].values;  // in_proj_weight: q, k, v blocks
  EXPECT_EQ(r->k_proj.values, std::vector<float>(packed.begin() + 256, packed.begin() + 512));
}

TEST_F(WeightsTest, LoadsSeparateProjectionsWithKdimVdim) {
  std::mt19937 rng(3);
  auto r = LoadModel(Write("kv", Safetensors({Rand(rng, "q_proj_weight", {16, 16}),
                                              Rand(rng, "k_proj_weight", {16, 8}),
                                              Rand(rng, "v_proj_weight", {16, 12}),
                                              Rand(rng, "out_proj.weight", {16, 16})})),
                     "kv");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->spec.kdim, 8);
  EXPECT_EQ(r->spec.vdim, 12);
  EXPECT_FALSE(r->spec.bias);
}

TEST_F(WeightsTest, LoadsBiasKvAndZeroAttnFromConfig) {
  auto r = LoadModel(Write("b", Safetensors(MhaEntries(16, true, true)),
                           R"({"num_heads": 2, "add_zero_attn": true})"),
                     "b");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->spec.add_bias_kv);
  EXPECT_TRUE(r->spec.add_zero_attn);
  EXPECT_EQ(r->bias_k->shape, (std::vector<int64_t>{16}));
}

TEST_F(WeightsTest, SeedNamingsGiveTheSameHashAsTheMhaNaming) {
  std::mt19937 rng(11);
  Entry q = Rand(rng, "", {16, 16}), k = Rand(rng, "", {16, 16}), v = Rand(rng, "", {16, 16}),
        o = Rand(rng, "", {16, 16});
  std::vector<float> packed = q.values;
  packed.insert(packed.end(), k.values.begin(), k.values.end());
  packed.insert(packed.end(), v.values.begin(), v.values.end());
  auto mha = LoadModel(Write("a", Safetensors({{"in_proj_weight", {48, 16}, packed},
                                               {"out_proj.weight", {16, 16}, o.values}})),
                       "a");
  auto seed000 = LoadModel(Write("b", Safetensors({{"W_q.weight", {16, 16}, q.values},
                                                   {"W_k.weight", {16, 16}, k.values},
                                                   {"W_v.weight", {16, 16}, v.values},
                                                   {"W_o.weight", {16, 16}, o.values}})),
                           "b");
  // A wrapper module's prefix (seed 002's `multi_head_attention.`) is stripped.
  auto wrapped = LoadModel(Write("c", Safetensors({{"mha.in_proj_weight", {48, 16}, packed},
                                                   {"mha.out_proj.weight", {16, 16}, o.values}})),
                           "c");
  ASSERT_TRUE(mha.ok() && seed000.ok() && wrapped.ok());
  EXPECT_EQ(mha->spec.weights_hash, seed000->spec.weights_hash);
  EXPECT_EQ(mha->spec.weights_hash, wrapped->spec.weights_hash);
}

TEST_F(WeightsTest, Seed003ValueBiasAloneBecomesZeroFilledInProjBias) {
  std::mt19937 rng(5);
  auto r = LoadModel(Write("s", Safetensors({Rand(rng, "query.linear.weight", {16, 16}),
                                             Rand(rng, "key.linear.weight", {16, 16}),
                                             Rand(rng, "value.linear.weight", {16, 16}),
                                             Rand(rng, "value.linear.bias", {16}),
                                             Rand(rng, "output.weight", {16, 16}),
                                             Rand(rng, "output.bias", {16})})),
                     "s");
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE(r->in_proj_bias.has_value());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(r->in_proj_bias->values[i], 0.f);
  EXPECT_NE(r->in_proj_bias->values[40], 0.f);
}

TEST_F(WeightsTest, DemoModelIsStable) {
  const ModelWeights a = DemoModelWeights(), b = DemoModelWeights();
  EXPECT_EQ(a.spec.embed_dim, 512);
  EXPECT_EQ(a.spec.num_heads, 8);
  EXPECT_EQ(a.spec.weights_hash, b.spec.weights_hash);
}

TEST_F(WeightsTest, RefusesTruncatedFile) {
  const std::string good = Safetensors(MhaEntries(16));
  EXPECT_THAT(LoadError(good.substr(0, 5)).message(), HasSubstr("truncated"));
  EXPECT_THAT(LoadError(good.substr(0, 40)).message(), HasSubstr("runs past the end"));
  EXPECT_THAT(LoadError(good.substr(0, good.size() - 10)).message(), HasSubstr("outside the"));
}

TEST_F(WeightsTest, RefusesHeaderLyingAboutOffsets) {
  std::string bytes = Safetensors(MhaEntries(16));
  const std::string from = "\"data_offsets\":[0,3072]";
  const size_t at = bytes.find(from);
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, from.size(), "\"data_offsets\":[4,3072]");
  const Status s = LoadError(bytes);
  EXPECT_THAT(s.message(),
              HasSubstr("model.safetensors: 'in_proj_weight': data_offsets span 3068 bytes"));
}

TEST_F(WeightsTest, RefusesHeaderLyingAboutShape) {
  std::string bytes = Safetensors(MhaEntries(16));
  const std::string from = "\"shape\":[48,16]";
  const size_t at = bytes.find(from);
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, from.size(), "\"shape\":[48,99]");
  EXPECT_THAT(LoadError(bytes).message(), HasSubstr("needs"));
}

TEST_F(WeightsTest, RefusesGarbageHeader) {
  std::string bytes(8, '\0');
  bytes[0] = 5;
  bytes += "nope!";
  const std::string message = LoadError(bytes).message();
  EXPECT_THAT(message, HasSubstr("model.safetensors: header: not valid JSON"));
  // Where, and what the parser read (a NaN in a config.json fails the same way: not JSON).
  EXPECT_THAT(message, HasSubstr("line 1, column 2"));
  EXPECT_THAT(message, HasSubstr("last read: 'no'"));
}

// A byte that is not printable ASCII reaches the message (and the log) escaped: the log stays
// valid UTF-8 whatever a file holds (a hostile review's config.json of 0xFF 0xFE).
TEST_F(WeightsTest, WhatTheParserReadIsQuotedAsPrintableAscii) {
  const std::string message =
      ParseStrictJson("{\"a\": \"\xff\xfe\x01\"}", "x/config.json").status().message();
  EXPECT_THAT(message, HasSubstr("x/config.json: not valid JSON"));
  EXPECT_THAT(message, HasSubstr("\\xff"));
  for (const char c : message) {
    const auto u = static_cast<unsigned char>(c);
    EXPECT_TRUE(u >= 0x20 && u < 0x7f) << "byte " << int(u) << " in: " << message;
  }
}

TEST_F(WeightsTest, RefusesWrongShapes) {
  std::mt19937 rng(1);
  EXPECT_THAT(LoadError(Safetensors({Rand(rng, "in_proj_weight", {40, 16}),
                                     Rand(rng, "out_proj.weight", {16, 16})}))
                  .message(),
              HasSubstr("'in_proj_weight' has shape [40, 16], expected [48, 16]"));
}

TEST_F(WeightsTest, RefusesMissingKeys) {
  std::mt19937 rng(1);
  EXPECT_THAT(LoadError(Safetensors({Rand(rng, "out_proj.weight", {16, 16})})).message(),
              HasSubstr("missing key 'q_proj_weight'"));
  EXPECT_THAT(
      LoadError(Safetensors({Rand(rng, "W_q.weight", {16, 16}), Rand(rng, "W_o.weight", {16, 16})}))
          .message(),
      HasSubstr("missing key 'W_k.weight'"));
  EXPECT_THAT(LoadError(Safetensors({Rand(rng, "foo", {16, 16})})).message(),
              HasSubstr("no output projection found"));
}

TEST_F(WeightsTest, RefusesUnexpectedKeys) {
  auto entries = MhaEntries(16);
  std::mt19937 rng(1);
  entries.push_back(Rand(rng, "extra", {2}));
  EXPECT_THAT(LoadError(Safetensors(entries)).message(), HasSubstr("unexpected key 'extra'"));
}

TEST_F(WeightsTest, RefusesEmbedDimNotDivisibleByHeads) {
  EXPECT_THAT(LoadError(Safetensors(MhaEntries(16)), R"({"num_heads": 3})").message(),
              HasSubstr("config.json: num_heads 3 does not divide embed_dim 16"));
}

TEST_F(WeightsTest, RefusesBadConfig) {
  const std::string w = Safetensors(MhaEntries(16));
  EXPECT_THAT(LoadError(w, "{}").message(), HasSubstr("num_heads (an integer) is required"));
  EXPECT_THAT(LoadError(w, "[1]").message(), HasSubstr("not a JSON object"));
  EXPECT_THAT(LoadError(w, R"({"num_heads": 4, "heads": 4})").message(),
              HasSubstr("unknown key 'heads'"));
}

TEST_F(WeightsTest, RefusesCorruptTorchArchive) {
  const Status s = LoadError("PK\x03\x04 this is not a zip", R"({"num_heads": 4})", "model.pt");
  EXPECT_THAT(s.message(), HasSubstr("model.pt: torch.save() archive:"));
}

TEST_F(WeightsTest, DirectoryWithOneBadModelFailsWhole) {
  Write("good", Safetensors(MhaEntries(16)));
  Write("zbad", Safetensors(MhaEntries(16)), R"({"num_heads": 5})");
  auto r = LoadModelDirectory(root_.string());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("zbad/model.safetensors"));
}

TEST_F(WeightsTest, DirectoryWithoutModelsIsRefused) {
  auto r = LoadModelDirectory(root_.string());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("no model found"));
}

}  // namespace
}  // namespace attnserve
