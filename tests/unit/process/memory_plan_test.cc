// Budgets sized to the container's memory limit, and the limit read from cgroup v1 and v2 files.
#include "server/process/memory_plan.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <filesystem>
#include <fstream>

#include "server/process/host_memory.h"

namespace attnserve {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// The defaults of the flags, none given.
MemoryBudgets Defaults() {
  MemoryBudgets b;
  b.kv_budget_bytes = int64_t{1} << 30;
  b.kv_max_entry_bytes = int64_t{256} << 20;
  b.max_inflight_bytes = int64_t{1} << 30;
  b.max_message_bytes = int64_t{64} << 20;
  return b;
}

MemoryPlanInput Input(int64_t limit_mib, MemoryBudgets b = Defaults()) {
  MemoryPlanInput in;
  in.limit_bytes = limit_mib * kMiB;
  in.limit_source = "memory.max";
  in.idle_bytes = 180 * kMiB;
  in.workers = 2;
  in.budgets = b;
  return in;
}

double Usable(int64_t limit_mib) { return static_cast<double>(limit_mib * kMiB) * 0.9; }

TEST(MemoryPlanTest, WithoutALimitNothingChanges) {
  const MemoryPlan plan = PlanMemory(Input(0));
  EXPECT_EQ(plan.budgets.kv_budget_bytes, Defaults().kv_budget_bytes);
  EXPECT_EQ(plan.budgets.max_inflight_bytes, Defaults().max_inflight_bytes);
  EXPECT_EQ(plan.budgets.max_message_bytes, Defaults().max_message_bytes);
  EXPECT_EQ(plan.description, "");
  EXPECT_EQ(plan.warning, "");
}

TEST(MemoryPlanTest, SmallContainersGetBudgetsThatFitUnderTheLimit) {
  for (int64_t limit : {512, 768, 1024, 2048, 4096}) {
    const MemoryPlan plan = PlanMemory(Input(limit));
    const MemoryBudgets& b = plan.budgets;
    SCOPED_TRACE(limit);
    EXPECT_LE(static_cast<double>(plan.peak_bytes), Usable(limit));
    EXPECT_EQ(plan.peak_bytes, EstimatePeak(180 * kMiB, 2, b));
    EXPECT_GE(b.max_inflight_bytes, 4 * b.max_message_bytes);  // A request and answer fit.
    EXPECT_LE(b.kv_max_entry_bytes, b.kv_budget_bytes);
    EXPECT_GE(b.max_message_bytes, kMiB);
    EXPECT_EQ(b.kv_budget_bytes % kMiB, 0);
    EXPECT_EQ(plan.warning, "");
    EXPECT_NE(plan.description.find("memory limit " + std::to_string(limit) + " MiB"),
              std::string::npos)
        << plan.description;
  }
  // 768 MiB: what is left after the idle size is shared 40/60 between kept keys and values and
  // requests in flight.
  const MemoryBudgets b = PlanMemory(Input(768)).budgets;
  EXPECT_EQ(b.kv_budget_bytes, 153 * kMiB);
  EXPECT_EQ(b.max_inflight_bytes, 19 * kMiB);
  EXPECT_EQ(b.max_message_bytes, 4 * kMiB);
}

TEST(MemoryPlanTest, LargeContainersKeepTheDefaults) {
  const MemoryPlan plan = PlanMemory(Input(64 * 1024));
  EXPECT_EQ(plan.budgets.kv_budget_bytes, Defaults().kv_budget_bytes);
  EXPECT_EQ(plan.budgets.max_inflight_bytes, Defaults().max_inflight_bytes);
  EXPECT_EQ(plan.budgets.max_message_bytes, Defaults().max_message_bytes);
  EXPECT_EQ(plan.warning, "");
  EXPECT_EQ(plan.description.find("--"), std::string::npos) << plan.description;
}

// A CUDA server's pinned staging is memory too: counted in the peak, lowered to a tenth of what a
// small limit leaves when not given, kept (and warned about) when given.
TEST(MemoryPlanTest, TheStagingIsCountedAndSizedToTheLimit) {
  MemoryBudgets gpu = Defaults();
  gpu.staging_bytes = int64_t{1} << 30;
  const MemoryPlan unlimited = PlanMemory(Input(0, gpu));
  EXPECT_EQ(unlimited.budgets.staging_bytes, int64_t{1} << 30);
  EXPECT_EQ(unlimited.peak_bytes, EstimatePeak(180 * kMiB, 2, Defaults()) + (int64_t{1} << 30));
  for (int64_t limit : {1024, 2048, 8192}) {
    SCOPED_TRACE(limit);
    const MemoryPlan plan = PlanMemory(Input(limit, gpu));
    EXPECT_LE(static_cast<double>(plan.peak_bytes), Usable(limit));
    EXPECT_LT(plan.budgets.staging_bytes, static_cast<int64_t>(0.1 * Usable(limit)));
    EXPECT_GE(plan.budgets.staging_bytes, kMiB);
    EXPECT_NE(plan.description.find("--staging-bytes"), std::string::npos) << plan.description;
    EXPECT_EQ(plan.warning, "");
  }
  gpu.given.staging = true;
  const MemoryPlan given = PlanMemory(Input(1024, gpu));
  EXPECT_EQ(given.budgets.staging_bytes, int64_t{1} << 30);
  EXPECT_NE(given.warning.find("--staging-bytes 1024 MiB"), std::string::npos) << given.warning;
  // The CPU stages nothing: the plan is as it was.
  EXPECT_EQ(PlanMemory(Input(768)).budgets.kv_budget_bytes, 153 * kMiB);
}

TEST(MemoryPlanTest, GivenFlagsAreKeptAndWarnedAboutWhenTheyCannotFit) {
  MemoryBudgets b = Defaults();
  b.given.kv_budget = b.given.inflight = true;
  const MemoryPlan plan = PlanMemory(Input(768, b));
  EXPECT_EQ(plan.budgets.kv_budget_bytes, int64_t{1} << 30);
  EXPECT_EQ(plan.budgets.max_inflight_bytes, int64_t{1} << 30);
  EXPECT_NE(plan.warning.find("--kv-budget-bytes 1024 MiB"), std::string::npos) << plan.warning;
  EXPECT_NE(plan.warning.find("memory limit 768 MiB"), std::string::npos) << plan.warning;
  // The message size, not given, is still sized to what is left (nothing: the least, 1 MiB).
  EXPECT_EQ(plan.budgets.max_message_bytes, kMiB);
}

TEST(MemoryPlanTest, GivenBudgetsThatFitAreKeptWithoutAWarning) {
  MemoryBudgets b = Defaults();
  b.kv_budget_bytes = 64 * kMiB;
  b.kv_max_entry_bytes = 16 * kMiB;
  b.given.kv_budget = b.given.kv_max_entry = true;
  const MemoryPlan plan = PlanMemory(Input(1024, b));
  EXPECT_EQ(plan.budgets.kv_budget_bytes, 64 * kMiB);
  EXPECT_EQ(plan.budgets.kv_max_entry_bytes, 16 * kMiB);
  EXPECT_EQ(plan.warning, "");
  EXPECT_LE(static_cast<double>(plan.peak_bytes), Usable(1024));
}

TEST(MemoryPlanTest, ATinyContainerGetsTheLeastAndAWarning) {
  const MemoryPlan plan = PlanMemory(Input(256));
  EXPECT_EQ(plan.budgets.max_message_bytes, kMiB);
  EXPECT_EQ(plan.budgets.max_inflight_bytes, kMiB);
  EXPECT_NE(plan.warning, "");
}

TEST(MemoryPlanTest, SizesAtTheInt64ExtremesStayInRange) {
  // The largest limit a cgroup can name, the largest each flag takes, and a limit of one byte.
  MemoryBudgets most = Defaults();
  most.kv_budget_bytes = int64_t{1} << 50;
  most.kv_max_entry_bytes = int64_t{1} << 50;
  most.max_inflight_bytes = int64_t{1} << 40;
  most.max_message_bytes = int64_t{1} << 30;
  most.given = {true, true, true, true};
  MemoryPlanInput in = Input(0, most);
  in.limit_bytes = INT64_MAX;
  MemoryPlan plan = PlanMemory(in);
  EXPECT_EQ(plan.budgets.kv_budget_bytes, int64_t{1} << 50);
  EXPECT_GT(plan.peak_bytes, int64_t{1} << 50);
  EXPECT_EQ(plan.warning, "");
  in.budgets = Defaults();
  plan = PlanMemory(in);
  EXPECT_EQ(plan.budgets.kv_budget_bytes, Defaults().kv_budget_bytes);
  EXPECT_EQ(plan.budgets.max_message_bytes, Defaults().max_message_bytes);
  in.limit_bytes = 1;
  plan = PlanMemory(in);
  EXPECT_EQ(plan.budgets.kv_budget_bytes, kMiB);  // The least each flag takes.
  EXPECT_EQ(plan.budgets.max_inflight_bytes, kMiB);
  EXPECT_EQ(plan.budgets.max_message_bytes, kMiB);
  EXPECT_NE(plan.warning, "");
}

// A fake cgroup tree: `files` relative to a temporary root, and /proc/self/cgroup's text.
class CgroupTree {
 public:
  CgroupTree() {
    char tmpl[] = "/tmp/attnserve-cgroup-XXXXXX";
    root_ = mkdtemp(tmpl);
  }
  ~CgroupTree() { std::filesystem::remove_all(root_); }
  void Write(const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root_ + "/" + path).parent_path());
    std::ofstream(root_ + "/" + path) << text;
  }
  MemoryLimit Read(const std::string& self) {
    Write("self", self);
    return ContainerMemoryLimit(root_ + "/fs", root_ + "/self");
  }

 private:
  std::string root_;
};

TEST(HostMemoryTest, CgroupV2TakesTheSmallestLimitAlongThePath) {
  CgroupTree t;
  t.Write("fs/cgroup.controllers", "cpu memory\n");
  t.Write("fs/kubepods/memory.max", "1073741824\n");
  t.Write("fs/kubepods/pod1/memory.max", "max\n");
  t.Write("fs/kubepods/pod1/c1/memory.max", "805306368\n");
  MemoryLimit m = t.Read("0::/kubepods/pod1/c1\n");
  EXPECT_EQ(m.bytes, 768 * kMiB);
  EXPECT_NE(m.source.find("kubepods/pod1/c1/memory.max"), std::string::npos);
  t.Write("fs/kubepods/pod1/c1/memory.max", "max\n");
  EXPECT_EQ(t.Read("0::/kubepods/pod1/c1\n").bytes, 1024 * kMiB);
}

TEST(HostMemoryTest, CgroupV2InItsOwnNamespaceReadsTheRoot) {
  CgroupTree t;
  t.Write("fs/cgroup.controllers", "memory\n");
  t.Write("fs/memory.max", "536870912\n");
  EXPECT_EQ(t.Read("0::/\n").bytes, 512 * kMiB);
}

TEST(HostMemoryTest, CgroupV1ReadsTheMemoryHierarchy) {
  CgroupTree t;
  t.Write("fs/memory/memory.limit_in_bytes", "9223372036854771712\n");  // The root: no limit.
  t.Write("fs/memory/docker/abc/memory.limit_in_bytes", "805306368\n");
  MemoryLimit m = t.Read("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n");
  EXPECT_EQ(m.bytes, 768 * kMiB);
  // A container whose own cgroup is mounted at the root while the path names the host's.
  CgroupTree own;
  own.Write("fs/memory/memory.limit_in_bytes", "805306368\n");
  EXPECT_EQ(own.Read("4:memory:/docker/abc\n").bytes, 768 * kMiB);
}

TEST(HostMemoryTest, NoLimitIsZero) {
  CgroupTree t;
  t.Write("fs/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(t.Read("4:memory:/\n").bytes, 0);
  CgroupTree none;
  EXPECT_EQ(none.Read("").bytes, 0);
  EXPECT_GT(ResidentBytes(), 0);
}

}  // namespace
}  // namespace attnserve
