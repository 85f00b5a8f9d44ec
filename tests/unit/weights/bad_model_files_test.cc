// Model loading never crashes, never hangs and never loads garbage: every bad file is a refusal
// that names the file and the problem. The torch.save() fixtures come from
// tests/data/make_fixtures.py (Debian's PyTorch 1.13).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "server/models/model_loader.h"
#include "server/weights/safetensors.h"
#include "server/weights/torch_archive.h"
#include "tests/lib/test_paths.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string Fixture(const std::string& name) {
  auto bytes = ReadFile(std::string(test_paths::kTestDataDir) + "/" + name);
  EXPECT_TRUE(bytes.ok()) << bytes.status().message();
  return bytes.ok() ? bytes.value() : std::string();
}

Status ArchiveError(const std::string& fixture) {
  auto r = ParseTorchArchive(Fixture(fixture), fixture);
  EXPECT_FALSE(r.ok()) << fixture << " was accepted";
  return r.ok() ? Status() : r.status();
}

TEST(TorchArchiveTest, ReadsRealArchivesExactlyAsTheirSafetensorsTwins) {
  for (const std::string name : {"mha_e8_h2", "views_mixed_dtypes"}) {
    auto got = ParseTorchArchive(Fixture(name + ".pt"), name + ".pt");
    ASSERT_TRUE(got.ok()) << got.status().message();
    auto want = ParseSafetensors(Fixture(name + ".safetensors"), name + ".safetensors");
    ASSERT_TRUE(want.ok()) << want.status().message();
    ASSERT_EQ(got->size(), want->size()) << name;
    for (const auto& [key, t] : want.value()) {
      ASSERT_TRUE(got->count(key)) << name << ": " << key;
      EXPECT_EQ(got->at(key).shape, t.shape) << name << ": " << key;
      EXPECT_EQ(got->at(key).values, t.values) << name << ": " << key;
    }
  }
}

TEST(TorchArchiveTest, RefusesHostileAndDamagedArchivesNamingTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"storage_cut_short.pt", "holds 764 bytes, expected 768"},
      {"storage_padded.pt", "holds 772 bytes, expected 768"},
      {"pickle_tuple1_on_empty_stack.pt", "TUPLE1 on a stack of 0"},
      {"pickle_global_os_system.pt", "global 'os.system' is not allowed"},
      {"pickle_truncated.pt", "data.pkl at byte"},
      {"crc_mismatch.pt", "CRC mismatch"},
      {"integer_weights.pt", "torch.LongStorage holds integer values"},
  };
  for (const auto& [file, why] : cases) {
    const Status s = ArchiveError(file);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << file;
    EXPECT_THAT(s.message(), HasSubstr(file)) << file;
    EXPECT_THAT(s.message(), HasSubstr(why)) << file;
  }
  // Every prefix of a real archive is refused without reading outside it.
  const std::string whole = Fixture("mha_e8_h2.pt");
  for (size_t n = 0; n < whole.size(); n += 37) {
    EXPECT_FALSE(ParseTorchArchive(whole.substr(0, n), "cut.pt").ok()) << n;
  }
}

// A safetensors file from a raw JSON header and data section.
std::string RawSafetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

TEST(SafetensorsTest, RefusesOverlapsHolesIntegersOverflowAndDuplicateKeys) {
  const std::string data(32, '\1');
  const std::pair<std::string, const char*> cases[] = {
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
       "overlaps"},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[24,32]}})",
       "bytes [16, 24) of the data section belong to no tensor"},
      {R"({"a":{"dtype":"I32","shape":[8],"data_offsets":[0,32]}})", "dtype I32 is not supported"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,32]}})",
       "more than 2^34 elements"},
      {R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})",
       "key 'a' appears twice"},
  };
  for (const auto& [header, why] : cases) {
    auto r = ParseSafetensors(RawSafetensors(header, data), "w.safetensors");
    ASSERT_FALSE(r.ok()) << header;
    EXPECT_THAT(r.status().message(), HasSubstr("w.safetensors")) << header;
    EXPECT_THAT(r.status().message(), HasSubstr(why)) << header;
  }
}

class LoadingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("attnserve-loading-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "m");
  }
  void TearDown() override { fs::remove_all(root_); }

  void Put(const std::string& name, const std::string& bytes) {
    std::ofstream(root_ / "m" / name, std::ios::binary) << bytes;
  }
  Status Error() {
    auto r = LoadModelDirectory(root_.string());
    EXPECT_FALSE(r.ok());
    return r.ok() ? Status() : r.status();
  }
  fs::path root_;
};

TEST_F(LoadingTest, SymbolicLinkLoopIsARefusalNotACrash) {
  Put("config.json", R"({"num_heads": 2})");
  Put("model.pt", Fixture("mha_e8_h2.pt"));
  fs::create_symlink(root_ / "loop_b", root_ / "loop_a");
  fs::create_symlink(root_ / "loop_a", root_ / "loop_b");
  const Status s = Error();
  EXPECT_THAT(s.message(), HasSubstr("loop_"));
  EXPECT_THAT(s.message(), HasSubstr("symbolic links"));
}

TEST_F(LoadingTest, FifoAsConfigOrWeightsIsRefusedWithoutWaiting) {
  Put("model.pt", Fixture("mha_e8_h2.pt"));
  ASSERT_EQ(mkfifo((root_ / "m" / "config.json").c_str(), 0600), 0);
  EXPECT_THAT(Error().message(), HasSubstr("m/config.json: not a regular file"));
  fs::remove(root_ / "m" / "config.json");
  fs::remove(root_ / "m" / "model.pt");
  Put("config.json", R"({"num_heads": 2, "weights": "model.pt"})");
  ASSERT_EQ(mkfifo((root_ / "m" / "model.pt").c_str(), 0600), 0);
  EXPECT_THAT(Error().message(), HasSubstr("m/model.pt: not a regular file"));
}

TEST_F(LoadingTest, BadNumHeadsIsBlamedOnConfigJson) {
  Put("model.pt", Fixture("mha_e8_h2.pt"));
  for (const char* heads : {"0", "-3", "18446744073709551615", "3"}) {
    Put("config.json", std::string(R"({"num_heads": )") + heads + "}");
    const Status s = Error();
    EXPECT_THAT(s.message(), HasSubstr("m/config.json: num_heads")) << heads;
  }
  Put("config.json", R"({"num_heads": 2, "num_heads": 4})");
  EXPECT_THAT(Error().message(), HasSubstr("config.json: key 'num_heads' appears twice"));
}

TEST_F(LoadingTest, NonFiniteWeightsAreRefusedNamingTheTensor) {
  auto good = ParseSafetensors(Fixture("mha_e8_h2.safetensors"), "x");
  ASSERT_TRUE(good.ok());
  std::string bytes = Fixture("mha_e8_h2.safetensors");
  // Put a NaN into the last float of the file (the data section's last tensor).
  const float nan = std::nanf("");
  std::memcpy(&bytes[bytes.size() - 4], &nan, 4);
  Put("config.json", R"({"num_heads": 2})");
  Put("model.safetensors", bytes);
  const Status s = Error();
  EXPECT_THAT(s.message(), HasSubstr("m/model.safetensors"));
  EXPECT_THAT(s.message(), HasSubstr("holds NaN at element"));
}

TEST_F(LoadingTest, RealArchiveLoadsAsAModel) {
  Put("config.json", R"({"num_heads": 2})");
  Put("model.pt", Fixture("mha_e8_h2.pt"));
  auto r = LoadModelDirectory(root_.string());
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ(r->at(0).spec.embed_dim, 8);
  EXPECT_TRUE(r->at(0).spec.add_bias_kv);
}

}  // namespace
TEST_F(LoadingTest, VersionDirectoriesAreVersionsAndTheOriginalLayoutIsVersionOne) {
  Put("config.json", R"({"num_heads": 2})");
  Put("model.pt", Fixture("mha_e8_h2.pt"));
  for (const char* v :
       {"1", "3", ".staging-4", "next"}) {  // The last two are not versions: ignored.
    fs::create_directories(root_ / "v" / v);
    std::ofstream(root_ / "v" / v / "config.json") << R"({"num_heads": 4})";
    std::ofstream(root_ / "v" / v / "model.pt", std::ios::binary) << Fixture("mha_e8_h2.pt");
  }
  auto r = LoadModelDirectory(root_.string());
  ASSERT_TRUE(r.ok()) << r.status().message();
  std::vector<std::pair<std::string, int64_t>> got;
  for (const ModelWeights& w : *r) got.emplace_back(w.spec.name, w.spec.version);
  EXPECT_EQ(got, (std::vector<std::pair<std::string, int64_t>>{{"m", 1}, {"v", 1}, {"v", 3}}));
  EXPECT_EQ(r->at(2).spec.num_heads, 4);

  // A fingerprint changes with config.json's text and with the weights file.
  auto before = ScanModelRepository(root_.string());
  ASSERT_TRUE(before.ok());
  std::ofstream(root_ / "v" / "3" / "config.json") << R"({"num_heads": 2})";
  auto after = ScanModelRepository(root_.string());
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(before->sources[0].fingerprint, after->sources[0].fingerprint);  // m: unchanged
  EXPECT_NE(before->sources[2].fingerprint, after->sources[2].fingerprint);
  fs::resize_file(root_ / "v" / "1" / "model.pt", 10);
  auto cut = ScanModelRepository(root_.string());
  ASSERT_TRUE(cut.ok());
  EXPECT_NE(after->sources[1].fingerprint, cut->sources[1].fingerprint);
}

TEST_F(LoadingTest, AmbiguousVersionLayoutsAreRefusedNamingTheDirectory) {
  Put("config.json", R"({"num_heads": 2})");
  Put("model.pt", Fixture("mha_e8_h2.pt"));
  fs::create_directories(root_ / "m" / "2");
  std::ofstream(root_ / "m" / "2" / "config.json") << R"({"num_heads": 2})";
  EXPECT_THAT(Error().message(), HasSubstr("m: has both config.json and version directories (2/)"));
  fs::remove(root_ / "m" / "config.json");
  fs::rename(root_ / "m" / "2", root_ / "m" / "02");
  EXPECT_THAT(Error().message(), HasSubstr("m/02: not a version number"));
}

}  // namespace attnserve

namespace attnserve {
namespace {

// config.json's "dynamic_batching": Triton's priority levels and queue policies, every bad value
// refused naming the field, a good one read into the model's spec.
TEST(ModelConfigTest, DynamicBatchingPrioritiesAreReadOrRefusedNamingTheField) {
  auto ok = ParseModelConfig(R"({"num_heads": 2, "dynamic_batching": {"priority_levels": 3,
      "default_priority_level": 2, "default_queue_policy": {"default_timeout_microseconds": 500,
      "allow_timeout_override": true}, "priority_queue_policy": {"1": {"max_queue_size": 4,
      "timeout_action": "DELAY"}}}})",
                             "m/config.json");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  ASSERT_TRUE(ok->priorities.has_value());
  EXPECT_EQ(ok->priorities->levels, 3);
  EXPECT_EQ(ok->priorities->default_level, 2);
  EXPECT_EQ(ok->priorities->PolicyOf(1).max_queue_size, 4);
  EXPECT_EQ(ok->priorities->PolicyOf(1).timeout_action, TimeoutAction::kDelay);
  EXPECT_EQ(ok->priorities->PolicyOf(2).default_timeout_us, 500);
  EXPECT_FALSE(ParseModelConfig(R"({"num_heads": 2})", "m/config.json")->priorities.has_value());
  const std::pair<const char*, const char*> bad[] = {
      {R"({"priority_levels": -1})", "dynamic_batching.priority_levels is -1"},
      {R"({"priority_levels": 2, "default_priority_level": 3})", "default_priority_level is 3"},
      {R"({"priority_levels": 2, "priority_queue_policy": {"3": {}}})", "names level 3"},
      {R"({"priority_levels": 2, "priority_queue_policy": {"x": {}}})",
       "'x' is not a level number"},
      {R"({"default_queue_policy": {"timeout_action": "DROP"}})", "timeout_action is \"DROP\""},
      {R"({"default_queue_policy": {"max_queue_size": 1.5}})", "max_queue_size is 1.5"},
      {R"({"default_queue_policy": {"max_queue_size": 9223372036854775808}})",
       "max_queue_size is 9223372036854775808"},
      {R"({"default_queue_policy": {"allow_timeout_override": 1}})", "expected true or false"},
      {R"({"default_queue_policy": {"preserve_ordering": true}})",
       "unknown key 'preserve_ordering'"},
      {R"({"max_batch_size": 8})", "unknown key 'max_batch_size'"},
      {R"([])", "dynamic_batching: expected an object"},
  };
  for (const auto& [batching, expected] : bad) {
    auto st = ParseModelConfig(
        std::string(R"({"num_heads": 2, "dynamic_batching": )") + batching + "}", "m/config.json");
    ASSERT_FALSE(st.ok()) << batching;
    EXPECT_EQ(st.status().code(), StatusCode::kFailedPrecondition) << batching;
    EXPECT_THAT(st.status().message(), HasSubstr(expected)) << batching;
    EXPECT_THAT(st.status().message(), HasSubstr("m/config.json")) << batching;
  }
}

}  // namespace
}  // namespace attnserve
