// The tenants file: every key, every bad value named, the labels the metrics use, the guarantees
// against the K/V budget up to the int64 extremes.
#include "server/tenants/tenants.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TenantsTest, ReadsEveryKeyAndGivesUnnamedTenantsTheDefault) {
  auto t = Tenants::Parse(R"({"default": {"weight": 0.5, "max_queued_requests": 8},
      "tenants": {"heavy": {"weight": 3, "kv_guaranteed_bytes": 100, "kv_max_bytes": 1000},
                  "CN=light.example": {}}})",
                          "t.json");
  ASSERT_TRUE(t.ok()) << t.status().message();
  const Tenants& tenants = **t;
  EXPECT_EQ(tenants.Of("heavy").weight, 3);
  EXPECT_EQ(tenants.Of("heavy").kv_guaranteed_bytes, 100);
  EXPECT_EQ(tenants.Of("heavy").kv_max_bytes, 1000);
  EXPECT_EQ(tenants.Of("heavy").max_queued_requests, 0);
  EXPECT_EQ(tenants.Of("stranger").weight, 0.5);
  EXPECT_EQ(tenants.Of("stranger").max_queued_requests, 8);
  EXPECT_EQ(tenants.Of("CN=light.example").weight, 1);
  EXPECT_EQ(tenants.Label("heavy"), "heavy");
  EXPECT_EQ(tenants.Label("default"), "default");
  EXPECT_EQ(tenants.Label("stranger"), "other");
  EXPECT_THAT(tenants.Labels(), ElementsAre("default", "CN=light.example", "heavy", "other"));
  EXPECT_TRUE(tenants.CheckAgainst(100).ok());
  EXPECT_EQ(tenants.CheckAgainst(99).code(), StatusCode::kFailedPrecondition);
}

TEST(TenantsTest, ReadsThePriorityCapAndTheSharedMemoryTerms) {
  auto t = Tenants::Parse(R"({"default": {"shared_memory_key_prefix": "{tenant}."},
      "tenants": {"low": {"best_priority_level": 2, "shared_memory_max_bytes": 1048576,
                          "shared_memory_key_prefix": "batch_jobs-v1."}}})",
                          "t.json");
  ASSERT_TRUE(t.ok()) << t.status().message();
  const Tenants& tenants = **t;
  EXPECT_EQ(tenants.Of("low").best_priority_level, 2);
  EXPECT_EQ(tenants.Of("low").shared_memory_max_bytes, 1048576);
  EXPECT_EQ(tenants.Of("low").shared_memory_key_prefix, "batch_jobs-v1.");
  EXPECT_EQ(tenants.Of("stranger").best_priority_level, 0);  // Absent: no cap.
  EXPECT_EQ(tenants.Of("stranger").shared_memory_max_bytes, 0);
  // Each unnamed tenant gets a prefix of its own from the default's placeholder.
  EXPECT_EQ(SharedMemoryKeyPrefix(tenants.Of("stranger"), "stranger").value(), "stranger.");
  EXPECT_EQ(SharedMemoryKeyPrefix(tenants.Of("other-one"), "other-one").value(), "other-one.");
  EXPECT_EQ(SharedMemoryKeyPrefix(tenants.Of("low"), "low").value(), "batch_jobs-v1.");
}

TEST(TenantsTest, TheKeyPrefixExpandsEveryPlaceholderAndNothingElse) {
  TenantPolicy p;
  EXPECT_EQ(SharedMemoryKeyPrefix(p, "a").value(), "");  // Any key.
  p.shared_memory_key_prefix = "{tenant}.";
  EXPECT_EQ(SharedMemoryKeyPrefix(p, "team-a").value(), "team-a.");
  p.shared_memory_key_prefix = "x.{tenant}.t_{tenant}.y";
  EXPECT_EQ(SharedMemoryKeyPrefix(p, "t").value(), "x.t.t_t.y");
  // A name that holds a '.' (or anything a key cannot) stands in no prefix: "a." would start the
  // keys of tenant "a.b"; nor is a name holding the placeholder's text expanded again.
  for (const char* name : {"a.b", "{tenant}", "a/b", ""}) {
    const StatusOr<std::string> refused = SharedMemoryKeyPrefix(p, name);
    if (std::string(name).empty()) {
      EXPECT_TRUE(refused.ok());
      continue;
    }
    EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << name;
    EXPECT_THAT(refused.status().message(), HasSubstr("shared_memory_key_prefix")) << name;
  }
  // A placeholder not followed by '.' refuses the file.
  for (const char* bad : {"{tenant}", "x{tenant}-", "{tenant}{tenant}."}) {
    const auto parsed = Tenants::Parse(
        std::string("{\"default\": {\"shared_memory_key_prefix\": \"") + bad + "\"}}", "t.json");
    EXPECT_FALSE(parsed.ok()) << bad;
    if (!parsed.ok()) EXPECT_THAT(parsed.status().message(), HasSubstr("followed by '.'")) << bad;
  }
  // The named tenants' prefixes beside one's own.
  auto named = Tenants::Parse(
      "{\"default\": {\"shared_memory_key_prefix\": \"{tenant}.\"}, \"tenants\": {\"a.b\": "
      "{\"shared_memory_key_prefix\": \"a.b.\"}, \"c\": {}, \"d\": {\"shared_memory_max_regions\": "
      "2}}}",
      "t.json");
  ASSERT_TRUE(named.ok()) << named.status().message();
  EXPECT_EQ((*named)->KeyPrefixesBeside("a"), (std::vector<std::string>{"a.b."}));
  EXPECT_EQ((*named)->KeyPrefixesBeside("a.b"), (std::vector<std::string>{}));
  EXPECT_EQ((*named)->Of("d").shared_memory_max_regions, 2);
  auto most = Tenants::Parse(
      "{\"default\": {\"shared_memory_key_prefix\": \"" + std::string(200, 'k') + "\"}}", "t.json");
  ASSERT_TRUE(most.ok()) << most.status().message();
  EXPECT_EQ(SharedMemoryKeyPrefix((*most)->Of("a"), "a").value(), std::string(200, 'k'));
  auto over = Tenants::Parse(
      "{\"tenants\": {\"a\": {\"shared_memory_key_prefix\": \"" + std::string(201, 'k') + "\"}}}",
      "t.json");
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(over.status().message(),
              HasSubstr("t.json: tenants['a'].shared_memory_key_prefix has 201 characters"));
}

TEST(TenantsTest, EveryBadFileIsRefusedNamingTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {"[]", "not a JSON object"},
      {"{", "t.json"},
      {R"({"defaults": {}})", "unknown key 'defaults'"},
      {R"({"tenants": []})", "tenants: expected an object"},
      {R"({"default": 3})", "default: expected an object"},
      {R"({"default": {"weight": 0}})", "default.weight is 0"},
      {R"({"default": {"weight": -1}})", "default.weight is -1"},
      {R"({"default": {"weight": "2"}})", "default.weight is \"2\""},
      {R"({"default": {"weight": 1e7}})", "default.weight is 10000000.0"},
      {R"({"tenants": {"a": {"wieght": 2}}})", "tenants['a']: unknown key 'wieght'"},
      {R"({"tenants": {"a": {"max_queued_requests": -1}}})",
       "tenants['a'].max_queued_requests is -1"},
      {R"({"tenants": {"a": {"max_queued_requests": 1.5}}})",
       "tenants['a'].max_queued_requests is 1.5"},
      {R"({"tenants": {"a": {"kv_max_bytes": 9223372036854775808}}})",
       "tenants['a'].kv_max_bytes is 9223372036854775808"},
      {R"({"tenants": {"a": {"kv_guaranteed_bytes": 10, "kv_max_bytes": 5}}})",
       "kv_guaranteed_bytes (10) is above its kv_max_bytes (5)"},
      {R"({"tenants": {"a": {"best_priority_level": -1}}})",
       "tenants['a'].best_priority_level is -1; allowed: 0 (no cap) or a priority level from 1"},
      {R"({"tenants": {"a": {"best_priority_level": 1.5}}})",
       "tenants['a'].best_priority_level is 1.5"},
      {R"({"tenants": {"a": {"best_priority_level": "1"}}})",
       "tenants['a'].best_priority_level is \"1\""},
      {R"({"default": {"shared_memory_max_bytes": -5}})",
       "default.shared_memory_max_bytes is -5; expected an integer from 0"},
      {R"({"default": {"shared_memory_max_bytes": true}})",
       "default.shared_memory_max_bytes is true"},
      {R"({"default": {"shared_memory_key_prefix": 7}})",
       "default.shared_memory_key_prefix is 7; allowed: a string of at most 200 characters"},
      {R"({"default": {"shared_memory_key_prefix": "a/b"}})",
       "default.shared_memory_key_prefix is \"a/b\", with a character not allowed at offset 1"},
      {R"({"default": {"shared_memory_key_prefix": "/a"}})",
       "not allowed at offset 0; allowed: a string of at most 200 characters: letters, digits, "
       "'.', '_', '-' and \"{tenant}\""},
      {R"({"default": {"shared_memory_key_prefix": "{tenant"}})", "not allowed at offset 0"},
      {R"({"default": {"shared_memory_key_prefix": "{user}."}})", "not allowed at offset 0"},
      {R"({"default": {"shared_memory_key_prefix": "a b"}})", "not allowed at offset 1"},
      {R"({"default": {"shared_memory_key_prefix": "caf\u00e9"}})", "not allowed at offset 3"},
      {R"({"tenants": {"a": {"shared_memory_prefix": "x"}}})",
       "tenants['a']: unknown key 'shared_memory_prefix'; allowed: weight, max_queued_requests, "
       "kv_guaranteed_bytes, kv_max_bytes, best_priority_level, shared_memory_max_bytes, "
       "shared_memory_max_regions, shared_memory_key_prefix"},
      {R"({"default": {"shared_memory_max_regions": -1}})",
       "default.shared_memory_max_regions is -1; expected an integer from 0"},
      {R"({"tenants": {"default": {}}})", "the name 'default' cannot name a tenant"},
      {R"({"tenants": {"other": {}}})", "the name 'other' cannot name a tenant"},
      {R"({"tenants": {"two words": {}}})", "the name 'two words' cannot name a tenant"},
      {R"({"tenants": {"": {}}})", "the name '' cannot name a tenant"},
  };
  for (const auto& [text, expected] : cases) {
    auto t = Tenants::Parse(text, "t.json");
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition) << text;
    EXPECT_THAT(t.status().message(), HasSubstr(expected)) << text;
    EXPECT_THAT(t.status().message(), HasSubstr("t.json")) << text;
  }
}

TEST(TenantsTest, GuaranteesAtTheInt64ExtremesDoNotWrap) {
  auto t = Tenants::Parse(R"({"default": {"kv_guaranteed_bytes": 9223372036854775807},
      "tenants": {"a": {"kv_guaranteed_bytes": 9223372036854775807}}})",
                          "t.json");
  ASSERT_TRUE(t.ok()) << t.status().message();
  const Status st = (*t)->CheckAgainst(INT64_MAX);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("add up to"));
}

TEST(TenantsTest, AMissingOrHugeFileIsRefusedNamingIt) {
  auto missing = Tenants::Load("/nonexistent/tenants.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/tenants.json"));
  const std::string path =
      (std::filesystem::temp_directory_path() / ("tenants_" + std::to_string(getpid()) + ".json"))
          .string();
  {
    std::ofstream f(path);
    f << "{\"tenants\": {}, \"pad\": \"" << std::string(2 << 20, 'x') << "\"}";
  }
  auto huge = Tenants::Load(path);
  std::remove(path.c_str());
  ASSERT_FALSE(huge.ok());
  EXPECT_THAT(huge.status().message(), HasSubstr(path));
}

TEST(TenantsTest, NamesAreBoundedPrintableAndWithoutSpaces) {
  EXPECT_TRUE(ValidTenantName("team-a"));
  EXPECT_TRUE(ValidTenantName("CN=svc.example.com"));
  EXPECT_TRUE(ValidTenantName(std::string(128, 'a')));
  EXPECT_FALSE(ValidTenantName(std::string(129, 'a')));
  EXPECT_FALSE(ValidTenantName(""));
  EXPECT_FALSE(ValidTenantName("a b"));
  EXPECT_FALSE(ValidTenantName("a\nb"));
  EXPECT_FALSE(ValidTenantName("caf\xc3\xa9"));
}

}  // namespace
}  // namespace attnserve
