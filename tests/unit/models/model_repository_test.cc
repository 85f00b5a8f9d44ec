// ModelRepository: reloads publish a new set atomically while readers run; models a request still
// holds outlive their removal and unload after it; failed loads keep what served. Runs under ASan
// and TSan too (tools/sanitize.sh).
#include "server/models/model_repository.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "tests/lib/test_paths.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Action = RepositoryChange::Action;

class ModelRepositoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("attnserve-repository-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // A version directory holding the E=8 fixture with `heads` heads (1, 2, 4 and 8 all divide 8,
  // so each gives a different model from the same weights file).
  void PutVersion(const fs::path& dir, int heads) {
    fs::create_directories(dir);
    fs::copy_file(fs::path(test_paths::kTestDataDir) / "mha_e8_h2.safetensors",
                  dir / "model.safetensors", fs::copy_options::overwrite_existing);
    std::ofstream(dir / "config.json") << "{\"num_heads\": " << heads << "}";
  }
  ReloadReport Reload(ModelRepository& repo) {
    std::promise<ReloadReport> done;
    repo.RequestReload([&](const ReloadReport& r) { done.set_value(r); });
    return done.get_future().get();
  }
  fs::path root_;
};

TEST_F(ModelRepositoryTest, ReloadPublishesAtomicallyAndRemovedModelsUnloadAfterTheirLastHolder) {
  PutVersion(root_ / "m" / "1", 2);
  auto opened = ModelRepository::Open(root_.string(), EngineOptions());
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  ModelRepository& repo = **opened;
  ASSERT_EQ(repo.Snapshot()->Find("m", 0)->spec().version, 1);

  // Readers take snapshots as requests do, all through the reloads below.
  std::atomic<bool> stop{false};
  std::atomic<int> regressions{0}, reads{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < 3; ++i) {
    readers.emplace_back([&] {
      int64_t last = 0;
      while (!stop) {
        const auto model = repo.Snapshot()->Find("m", 0);
        const int64_t v = model ? model->spec().version : 0;
        if (v != 0 && v < last) ++regressions;
        last = std::max(last, v);
        ++reads;
      }
    });
  }
  // The readers read before the reload and after it (on a busy machine they may start late).
  const auto await_reads = [&reads](int more) {
    const int target = reads.load() + more;
    while (reads.load() < target) std::this_thread::yield();
  };
  await_reads(3);
  PutVersion(root_ / "m" / "2", 4);
  ReloadReport r = Reload(repo);
  ASSERT_TRUE(r.status.ok()) << r.status.message();
  ASSERT_EQ(r.changes.size(), 1u);
  EXPECT_EQ(r.changes[0].name, "m");
  EXPECT_EQ(r.changes[0].version, 2);
  EXPECT_EQ(r.changes[0].action, Action::kLoaded);
  EXPECT_EQ(r.models_served, 2);
  std::shared_ptr<const AttentionModel> in_flight =
      repo.Snapshot()->Find("m", 0);  // A request's hold.
  EXPECT_EQ(in_flight->spec().num_heads, 4);
  std::weak_ptr<const AttentionModel> watch = in_flight;
  await_reads(3);
  stop = true;
  for (auto& t : readers) t.join();
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(regressions.load(), 0) << "a reader saw version 1 after version 2";

  fs::remove_all(root_ / "m" / "2");
  r = Reload(repo);
  ASSERT_EQ(r.changes.size(), 1u);
  EXPECT_EQ(r.changes[0].action, Action::kUnloaded);
  EXPECT_EQ(repo.Snapshot()->Find("m", 0)->spec().version, 1);
  EXPECT_EQ(repo.Snapshot()->Find("m", 2), nullptr);
  EXPECT_FALSE(watch.expired()) << "a model still held by a request must stay loaded";
  EXPECT_EQ(in_flight->spec().num_heads, 4);
  in_flight.reset();
  EXPECT_TRUE(watch.expired()) << "a removed model must unload after its last holder";
}

TEST_F(ModelRepositoryTest, FailedLoadKeepsWhatServedAndIsReported) {
  PutVersion(root_ / "m" / "1", 2);
  auto opened = ModelRepository::Open(root_.string(), EngineOptions());
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  ModelRepository& repo = **opened;
  const std::string hash = repo.Snapshot()->Find("m", 1)->spec().weights_hash;
  std::map<std::string, std::string> failing;
  ModelRepositoryHooks hooks;
  hooks.on_reloaded = [&](const ReloadReport&, const ModelSet&,
                          const std::map<std::string, std::string>& f) { failing = f; };
  repo.SetHooks(hooks);

  std::ofstream(root_ / "m" / "1" / "config.json") << R"({"num_heads": 3})";  // 3 does not divide 8
  ReloadReport r = Reload(repo);
  ASSERT_EQ(r.changes.size(), 1u);
  EXPECT_EQ(r.changes[0].action, Action::kFailed);
  EXPECT_THAT(r.changes[0].message, HasSubstr("m/1/config.json: num_heads 3"));
  EXPECT_EQ(r.changes[0].weights_hash, hash) << "what still serves";
  EXPECT_EQ(repo.Snapshot()->Find("m", 1)->spec().num_heads, 2);
  EXPECT_EQ(failing.count("m"), 1u);

  // A malformed model directory is a failure too, and its model keeps serving.
  PutVersion(root_ / "m" / "01", 2);
  r = Reload(repo);
  ASSERT_FALSE(r.changes.empty());
  EXPECT_THAT(r.changes[0].message, HasSubstr("not a version number"));
  EXPECT_NE(repo.Snapshot()->Find("m", 1), nullptr);
  fs::remove_all(root_ / "m" / "01");

  // Fixed: it loads, and the failure ends.
  std::ofstream(root_ / "m" / "1" / "config.json") << R"({"num_heads": 8})";
  r = Reload(repo);
  ASSERT_EQ(r.changes.size(), 1u);
  EXPECT_EQ(r.changes[0].action, Action::kUpdated);
  EXPECT_EQ(repo.Snapshot()->Find("m", 1)->spec().num_heads, 8);
  EXPECT_TRUE(failing.empty());

  // A reload that would leave nothing to serve changes nothing.
  fs::remove_all(root_ / "m");
  r = Reload(repo);
  EXPECT_EQ(r.status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status.message(), HasSubstr("would leave no model"));
  EXPECT_NE(repo.Snapshot()->Find("m", 1), nullptr);
}

TEST_F(ModelRepositoryTest, DemoHasNothingToReloadAndStopAnswersWaitingReloads) {
  auto demo = ModelRepository::Open("", EngineOptions());
  ASSERT_TRUE(demo.ok());
  EXPECT_EQ(Reload(**demo).status.code(), StatusCode::kFailedPrecondition);

  PutVersion(root_ / "m", 2);  // The unversioned layout: version 1.
  auto opened = ModelRepository::Open(root_.string(), EngineOptions());
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  EXPECT_EQ((*opened)->Snapshot()->Find("m", 1)->spec().version, 1);
  (*opened)->Stop();
  EXPECT_EQ(Reload(**opened).status.code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve
