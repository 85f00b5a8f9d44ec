// A decoder layer's attention read from a Hugging Face-style checkpoint: config.json's keys and
// each family's defaults (as transformers 5 reads a config.json that leaves them out), the
// tensors of one layer out of a whole model's file or shards, and every refusal with its message.
#include "server/weights/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "server/models/model_loader.h"
#include "tests/lib/safetensors_writer.h"
#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

StatusOr<ModelSpec> Parse(const nlohmann::json& j, int64_t layer = 0) {
  return ParseCheckpointConfig(j.dump(), layer, "ckpt/config.json");
}

TEST(CheckpointConfigTest, LlamaDefaultsAndItsBiasKey) {
  auto s = Parse({{"model_type", "llama"},
                  {"hidden_size", 64},
                  {"num_attention_heads", 4},
                  {"num_hidden_layers", 2}});
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->embed_dim, 64);
  EXPECT_EQ(s->num_heads, 4);
  EXPECT_EQ(s->kv_heads(), 4);  // num_key_value_heads missing: num_attention_heads.
  EXPECT_EQ(s->head_dim(), 16);
  ASSERT_TRUE(s->decoder->rotary);
  EXPECT_EQ(s->decoder->rotary->theta, 10000.0);
  EXPECT_EQ(s->decoder->rotary->rotary_dim, 16);
  EXPECT_FALSE(s->decoder->q_bias || s->decoder->o_bias);
  EXPECT_EQ(s->decoder->sliding_window, 0);
  auto biased = Parse({{"model_type", "llama"},
                       {"hidden_size", 64},
                       {"num_attention_heads", 4},
                       {"num_key_value_heads", 2},
                       {"attention_bias", true},
                       {"num_hidden_layers", 2}});
  ASSERT_TRUE(biased.ok());
  EXPECT_TRUE(biased->decoder->q_bias && biased->decoder->k_bias && biased->decoder->v_bias &&
              biased->decoder->o_bias);
  EXPECT_EQ(biased->kv_heads(), 2);
}

TEST(CheckpointConfigTest, MistralAndQwenDefaultsThatBite) {
  // Mistral: 8 key/value heads and a 4,096-token window when the keys are missing; null: none.
  auto m = Parse({{"model_type", "mistral"}, {"hidden_size", 256}, {"num_attention_heads", 16}});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->kv_heads(), 8);
  EXPECT_EQ(m->decoder->sliding_window, 4096);
  auto no_window = Parse({{"model_type", "mistral"},
                          {"hidden_size", 256},
                          {"num_attention_heads", 16},
                          {"sliding_window", nullptr}});
  ASSERT_TRUE(no_window.ok());
  EXPECT_EQ(no_window->decoder->sliding_window, 0);
  // Qwen3: head_dim 128 whatever hidden/heads; q/k norms; 32 key/value heads by default.
  auto q3 = Parse({{"model_type", "qwen3"}, {"hidden_size", 64}, {"num_attention_heads", 32}});
  ASSERT_TRUE(q3.ok()) << q3.status().message();
  EXPECT_EQ(q3->head_dim(), 128);
  EXPECT_EQ(q3->kv_heads(), 32);
  EXPECT_TRUE(q3->decoder->qk_norm);
  // Qwen2: q/k/v biases always, never o; no window unless use_sliding_window, then on the layers
  // from max_window_layers (or as layer_types says).
  const nlohmann::json q2 = {{"model_type", "qwen2"},    {"hidden_size", 64},
                             {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                             {"num_hidden_layers", 3},   {"sliding_window", 16},
                             {"max_window_layers", 1}};
  auto plain = Parse(q2, 2);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->decoder->q_bias && plain->decoder->v_bias && !plain->decoder->o_bias);
  EXPECT_EQ(plain->decoder->sliding_window, 0);  // use_sliding_window false: ignored.
  nlohmann::json on = q2;
  on["use_sliding_window"] = true;
  EXPECT_EQ(Parse(on, 0)->decoder->sliding_window, 0);
  EXPECT_EQ(Parse(on, 1)->decoder->sliding_window, 16);
  on["layer_types"] = {"sliding_attention", "full_attention", "full_attention"};
  EXPECT_EQ(Parse(on, 0)->decoder->sliding_window, 16);
  EXPECT_EQ(Parse(on, 1)->decoder->sliding_window, 0);
}

TEST(CheckpointConfigTest, BothGenerationsOfRopeKeys) {
  const nlohmann::json base = {{"model_type", "llama"},
                               {"hidden_size", 64},
                               {"num_attention_heads", 4},
                               {"max_position_embeddings", 4096}};
  nlohmann::json old_style = base;
  old_style["rope_theta"] = 500000.0;
  old_style["rope_scaling"] = {{"rope_type", "llama3"},
                               {"factor", 8.0},
                               {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0},
                               {"original_max_position_embeddings", 8192}};
  nlohmann::json new_style = base;
  new_style["rope_parameters"] = {
      {"rope_type", "llama3"},   {"rope_theta", 500000.0},
      {"factor", 8.0},           {"low_freq_factor", 1.0},
      {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  for (const auto& j : {old_style, new_style}) {
    auto s = Parse(j);
    ASSERT_TRUE(s.ok()) << s.status().message();
    const RotarySpec& r = *s->decoder->rotary;
    EXPECT_EQ(r.type, "llama3");
    EXPECT_EQ(r.theta, 500000.0);
    EXPECT_EQ(r.factor, 8.0);
    EXPECT_EQ(r.original_max_position, 8192);
  }
  nlohmann::json partial = base;
  partial["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(Parse(partial)->decoder->rotary->rotary_dim, 8);
  // llama3 without its original length takes max_position_embeddings.
  nlohmann::json no_original = new_style;
  no_original["rope_parameters"].erase("original_max_position_embeddings");
  EXPECT_EQ(Parse(no_original)->decoder->rotary->original_max_position, 4096);
}

TEST(CheckpointConfigTest, RefusalsNameTheKeyWhatArrivedAndWhatIsAllowed) {
  const nlohmann::json base = {{"model_type", "llama"},
                               {"hidden_size", 64},
                               {"num_attention_heads", 4},
                               {"num_hidden_layers", 2}};
  struct Bad {
    std::function<void(nlohmann::json&)> edit;
    int64_t layer;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {[](nlohmann::json& j) { j["model_type"] = "gpt2"; }, 0, "model_type 'gpt2' is not served"},
      {[](nlohmann::json& j) { j.erase("model_type"); }, 0, "model_type (a string) is required"},
      {[](nlohmann::json&) {}, 2, "layer 2 does not exist; the checkpoint has 2 (0 to 1)"},
      {[](nlohmann::json&) {}, -1, "layer -1 does not exist"},
      {[](nlohmann::json& j) { j["num_key_value_heads"] = 3; }, 0,
       "does not divide num_attention_heads 4"},
      {[](nlohmann::json& j) { j["num_key_value_heads"] = 0; }, 0, "num_key_value_heads is 0"},
      {[](nlohmann::json& j) { j["hidden_size"] = -5; }, 0, "hidden_size is -5"},
      {[](nlohmann::json& j) { j["num_attention_heads"] = 18446744073709551615ull; }, 0,
       "num_attention_heads is"},
      {[](nlohmann::json& j) {
         j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4}};
       },
       0, "rope_type 'yarn' is not served"},
      {[](nlohmann::json& j) {
         j["rope_parameters"] = {{"rope_type", "llama3"}};
       },
       0, "llama3 needs factor"},
      {[](nlohmann::json& j) { j["rope_theta"] = -1; }, 0, "rope_theta is -1"},
      // Positive, but 0 in float32, where the inverse frequencies are computed: every answer NaN.
      {[](nlohmann::json& j) { j["rope_theta"] = 1e-300; }, 0,
       "rope_theta 1e-300 gives inverse frequencies that are not finite in float32"},
      {[](nlohmann::json& j) {
         j["rope_parameters"] = {
             {"rope_type", "llama3"}, {"rope_theta", 5e5},
             {"factor", 1e-300},      {"low_freq_factor", 1},
             {"high_freq_factor", 4}, {"original_max_position_embeddings", 8192}};
       },
       0, "factor 1e-300 gives inverse frequencies that are not finite in float32"},
      {[](nlohmann::json& j) { j["rms_norm_eps"] = 1e-320; }, 0,
       "rms_norm_eps is 1e-320, which is 0 in float32"},
      {[](nlohmann::json& j) { j["partial_rotary_factor"] = 0.2; }, 0, "expected an even number"},
      {[](nlohmann::json& j) {
         j["rope_parameters"] = {{"full_attention", {{"rope_theta", 1e4}}}};
       },
       0, "RoPE per layer type is not served"},
  };
  for (const Bad& b : bad) {
    nlohmann::json j = base;
    b.edit(j);
    auto s = Parse(j, b.layer);
    ASSERT_FALSE(s.ok()) << b.says;
    EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.status().message(), HasSubstr(b.says));
    EXPECT_THAT(s.status().message(), HasSubstr("ckpt/config.json"));
  }
}

using Entry = testing::TensorEntry;

void WriteSafetensors(const fs::path& path, const std::vector<Entry>& entries) {
  std::ofstream(path, std::ios::binary) << testing::SafetensorsBytes(entries);
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("attnserve-checkpoint-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "ckpt");
  }
  void TearDown() override { fs::remove_all(root_); }

  // A two-layer Qwen2 checkpoint (e 16, 4 heads, 2 key/value heads, head_dim 4): every layer's
  // attention plus tensors attnserve skips.
  std::vector<Entry> Qwen2Entries() {
    std::mt19937 rng(3);
    std::vector<Entry> v;
    const auto add = [&](const std::string& name, std::vector<int64_t> shape) {
      v.push_back({name, shape, testing::RandomFloats(rng, testing::Numel(shape))});
    };
    add("model.embed_tokens.weight", {10, 16});
    for (int i = 0; i < 2; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      add(p + "self_attn.q_proj.weight", {16, 16});
      add(p + "self_attn.q_proj.bias", {16});
      add(p + "self_attn.k_proj.weight", {8, 16});
      add(p + "self_attn.k_proj.bias", {8});
      add(p + "self_attn.v_proj.weight", {8, 16});
      add(p + "self_attn.v_proj.bias", {8});
      add(p + "self_attn.o_proj.weight", {16, 16});
      add(p + "mlp.up_proj.weight", {32, 16});
    }
    return v;
  }
  void WriteConfig(const nlohmann::json& j) {
    std::ofstream(root_ / "ckpt" / "config.json") << j.dump();
  }
  nlohmann::json Qwen2Config() {
    return {{"model_type", "qwen2"},
            {"hidden_size", 16},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"num_hidden_layers", 2}};
  }
  fs::path root_;
};

TEST_F(CheckpointTest, ReadsOneLayerOutOfAWholeModelsFile) {
  const std::vector<Entry> entries = Qwen2Entries();
  WriteSafetensors(root_ / "ckpt" / "model.safetensors", entries);
  WriteConfig(Qwen2Config());
  auto w = LoadCheckpointLayer((root_ / "ckpt").string(), 1);
  ASSERT_TRUE(w.ok()) << w.status().message();
  const auto find = [&](const std::string& n) {
    for (const Entry& e : entries)
      if (e.name == n) return e.values;
    return std::vector<float>();
  };
  EXPECT_EQ(w->q_proj.values, find("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_EQ(w->k_proj.shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(w->out_proj.values, find("model.layers.1.self_attn.o_proj.weight"));
  ASSERT_TRUE(w->in_proj_bias);  // q, k and v biases in one [16 + 8 + 8].
  std::vector<float> bias = find("model.layers.1.self_attn.q_proj.bias");
  for (const char* n : {"k_proj", "v_proj"}) {
    const std::vector<float> b = find(std::string("model.layers.1.self_attn.") + n + ".bias");
    bias.insert(bias.end(), b.begin(), b.end());
  }
  EXPECT_EQ(w->in_proj_bias->values, bias);
  EXPECT_FALSE(w->out_proj_bias);
  EXPECT_EQ(w->spec.kv_heads(), 2);
  EXPECT_THAT(w->spec.weights_hash, HasSubstr("sha256:"));
  auto layer0 = LoadCheckpointLayer((root_ / "ckpt").string(), 0);
  ASSERT_TRUE(layer0.ok());
  EXPECT_NE(layer0->spec.weights_hash, w->spec.weights_hash);
}

TEST_F(CheckpointTest, ReadsShardsThroughTheIndex) {
  const std::vector<Entry> entries = Qwen2Entries();
  std::vector<Entry> a(entries.begin(), entries.begin() + 5), b(entries.begin() + 5, entries.end());
  WriteSafetensors(root_ / "ckpt" / "model-00001-of-00002.safetensors", a);
  WriteSafetensors(root_ / "ckpt" / "model-00002-of-00002.safetensors", b);
  nlohmann::json map = nlohmann::json::object();
  for (const Entry& e : a) map[e.name] = "model-00001-of-00002.safetensors";
  for (const Entry& e : b) map[e.name] = "model-00002-of-00002.safetensors";
  std::ofstream(root_ / "ckpt" / "model.safetensors.index.json")
      << nlohmann::json{{"weight_map", map}}.dump();
  WriteConfig(Qwen2Config());
  auto w = LoadCheckpointLayer((root_ / "ckpt").string(), 0);  // Its tensors lie in both shards.
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->q_proj.values, entries[1].values);
  // A shard named outside the checkpoint's directory is refused.
  map["model.layers.0.self_attn.q_proj.weight"] = "../elsewhere.safetensors";
  std::ofstream(root_ / "ckpt" / "model.safetensors.index.json")
      << nlohmann::json{{"weight_map", map}}.dump();
  auto outside = LoadCheckpointLayer((root_ / "ckpt").string(), 0);
  ASSERT_FALSE(outside.ok());
  EXPECT_THAT(outside.status().message(),
              HasSubstr("expected a file name in the checkpoint's directory"));
}

TEST_F(CheckpointTest, MissingOrMisshapenTensorsAreNamed) {
  std::vector<Entry> entries = Qwen2Entries();
  entries.erase(entries.begin() + 2);  // layer 0's q_proj.bias
  WriteSafetensors(root_ / "ckpt" / "model.safetensors", entries);
  WriteConfig(Qwen2Config());
  auto missing = LoadCheckpointLayer((root_ / "ckpt").string(), 0);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(),
              HasSubstr("has no tensor 'model.layers.0.self_attn.q_proj.bias'"));
  nlohmann::json wider = Qwen2Config();
  wider["num_key_value_heads"] = 4;  // k_proj would be [16, 16]; the file has [8, 16].
  WriteConfig(wider);
  auto shape = LoadCheckpointLayer((root_ / "ckpt").string(), 1);
  ASSERT_FALSE(shape.ok());
  EXPECT_THAT(shape.status().message(), HasSubstr("'model.layers.1.self_attn.k_proj.weight' has "
                                                  "shape [8, 16]; config.json makes it [16, 16]"));
}

TEST_F(CheckpointTest, AModelDirectoryNamesACheckpointAndALayer) {
  WriteSafetensors(root_ / "ckpt" / "model.safetensors", Qwen2Entries());
  WriteConfig(Qwen2Config());
  fs::create_directories(root_ / "repo" / "layer1");
  std::ofstream(root_ / "repo" / "layer1" / "config.json")
      << R"({"checkpoint": "../../ckpt", "layer": 1})";
  auto w = LoadModel((root_ / "repo" / "layer1").string(), "layer1");
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->spec.name, "layer1");
  EXPECT_EQ(w->spec.decoder->layer, 1);
  for (const char* bad : {R"({"checkpoint": "../../ckpt"})",
                          R"({"checkpoint": "../../ckpt", "layer": 0, "num_heads": 4})",
                          R"({"layer": 0})", R"({"checkpoint": "../../ckpt", "layer": -1})"}) {
    std::ofstream(root_ / "repo" / "layer1" / "config.json") << bad;
    auto r = LoadModel((root_ / "repo" / "layer1").string(), "layer1");
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << bad;
  }
}

}  // namespace
}  // namespace attnserve
