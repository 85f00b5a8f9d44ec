// The shared-memory registry: every safety rule of the Open Inference Protocol's shared-memory
// extension as attnserve keeps it, each with a case that fails without its check, and a random
// operation sequence against a plain model of what it should hold (counts equal sums, a failed
// operation changes nothing, a region held by a request outlives its unregistration).
#include "server/shm/shared_memory.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "server/core/peer.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A POSIX shared memory object of `size` bytes (i % 251 at byte i), unlinked at the end.
class Object {
 public:
  explicit Object(int64_t size, const std::string& tag = "") {
    key_ = "/attnserve-shm-test-" + std::to_string(::getpid()) + "-" + tag +
           std::to_string(counter_++);
    const int fd = ::shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::ftruncate(fd, size), 0);
    std::string bytes(static_cast<size_t>(size), '\0');
    for (int64_t i = 0; i < size; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>(i % 251);
    EXPECT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(size));
    ::close(fd);
  }
  ~Object() { ::shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }
  void Truncate(int64_t size) const {
    const int fd = ::shm_open(key_.c_str(), O_RDWR, 0);
    EXPECT_EQ(::ftruncate(fd, size), 0);
    ::close(fd);
  }
  int64_t Size() const {
    const int fd = ::shm_open(key_.c_str(), O_RDONLY, 0);
    struct stat st {};
    ::fstat(fd, &st);
    ::close(fd);
    return st.st_size;
  }

 private:
  std::string key_;
  static inline int counter_ = 0;
};

SharedMemoryOptions On(int64_t max_bytes = int64_t{1} << 30, size_t max_regions = 64) {
  SharedMemoryOptions o;
  o.allowed = true;
  o.max_bytes = max_bytes;
  o.max_regions = max_regions;
  return o;
}

TEST(SharedMemoryTest, OffUnlessAllowed) {
  Object obj(64);
  SharedMemoryRegistry off_all(SharedMemoryOptions{});
  const TenantRegions off = off_all.For({});
  const Status st = off.RegisterSystem("r", obj.key(), 0, 64);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("--allow-shared-memory"));
  EXPECT_EQ(off.Find("r").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(off_all.regions(), 0u);
}

TEST(SharedMemoryTest, OnlyPosixSharedMemoryKeysNeverAPath) {
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  for (const char* key : {"", "/", "/../../etc/passwd", "../etc/passwd", "/a/b", "/etc/passwd/",
                          ".", "/..", "/name with space", "/ctl\n"}) {
    const Status st = reg.RegisterSystem("r", key, 0, 1);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << key;
    EXPECT_THAT(st.message(), HasSubstr("never a path")) << key;
  }
  EXPECT_TRUE(IsSharedMemoryKey("/input_0.a-b"));
  EXPECT_TRUE(IsSharedMemoryKey("plain"));
  EXPECT_EQ(reg.RegisterSystem("r", "/attnserve-no-such-object", 0, 1).code(),
            StatusCode::kNotFound);
  EXPECT_EQ(reg_all.regions(), 0u);
}

// Runs `body` in a child process that is uid 65534 (nobody): its exit status, or -1 when it did
// not end within `seconds` (killed). Only root can become another user.
int AsNobody(const std::function<int()>& body, int seconds) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(99);
    ::_exit(body());
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -2;
}

// Issue 48: a FIFO another user made in /dev/shm, registered by a server running as an ordinary
// user, blocked open() waiting for a writer (two such calls and the server stopped answering).
// Anything but a regular object is refused, at once, without blocking.
TEST(SharedMemoryTest, AFifoOrAnythingButARegularObjectIsRefusedAtOnce) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: the FIFO's owner and the server differ";
  const std::string key = "/attnserve-fifo-" + std::to_string(::getpid());
  const std::string file = "/dev/shm" + key;
  ASSERT_EQ(::mkfifo(file.c_str(), 0644), 0);  // root's; others may read it only
  {
    SharedMemoryRegistry reg_all(On());
    const TenantRegions reg = reg_all.For({});
    const Status st = reg.RegisterSystem("r", key, 0, 1);  // root: the open itself succeeds
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("not a regular"));
  }
  // nobody: O_RDWR is refused, and a read-only open of a FIFO waits for a writer unless it is
  // non-blocking. 0: refused with the message; 1: registered; 2: another refusal.
  const int outcome = AsNobody(
      [&] {
        SharedMemoryRegistry reg_all(On());
        const TenantRegions reg = reg_all.For({});
        const Status st = reg.RegisterSystem("r", key, 0, 1);
        if (st.ok()) return 1;
        return st.message().find("not a regular") != std::string::npos ? 0 : 2;
      },
      5);
  EXPECT_EQ(outcome, 0) << "-1: the registration blocked";
  // The FIFO is never opened (a hostile review, 2026-11-28: a reader waiting on its own FIFO was
  // released with EOF when a caller registered it): a reader waiting stays waiting.
  std::atomic<bool> released{false};
  std::thread reader([&] {
    const int r = ::open(file.c_str(), O_RDONLY);  // Waits for a writer.
    released = true;
    if (r >= 0) ::close(r);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  {
    SharedMemoryRegistry reg_all(On());
    const TenantRegions reg = reg_all.For({});
    EXPECT_EQ(reg.RegisterSystem("r", key, 0, 1).code(), StatusCode::kInvalidArgument);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(released.load()) << "the registration opened the FIFO";
  const int writer = ::open(file.c_str(), O_WRONLY | O_NONBLOCK);  // Lets the reader go.
  reader.join();
  if (writer >= 0) ::close(writer);
  ::unlink(file.c_str());
  // A link, a directory: the same refusal (not an error of opening them).
  const std::string link = "/dev/shm" + key + "-link", dir = "/dev/shm" + key + "-dir";
  Object target(8);
  ASSERT_EQ(::symlink(("/dev/shm" + target.key()).c_str(), link.c_str()), 0);
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  for (const std::string& k : {key + "-link", key + "-dir"}) {
    const Status st = reg.RegisterSystem("r", k, 0, 1);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << k << ": " << st.message();
    EXPECT_THAT(st.message(), HasSubstr("not a regular")) << k;
  }
  ::unlink(link.c_str());
  ::rmdir(dir.c_str());
}

// Issue 48: the server, running as root, wrote an answer into an object another user owned (mode
// 0600) because a caller named it. Only objects of the server's own uid, or of uids the operator
// lists (--shared-memory-uids), are registered.
TEST(SharedMemoryTest, AnObjectOfAnotherUidIsRefusedUnlessListed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: to give the object to another uid";
  Object obj(64);
  const int fd = ::shm_open(obj.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchown(fd, 65534, 65534), 0);
  ::close(fd);
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  const Status st = reg.RegisterSystem("r", obj.key(), 0, 64);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("uid 65534"));
  EXPECT_THAT(st.message(), HasSubstr("--shared-memory-uids"));
  EXPECT_EQ(reg_all.regions(), 0u);
  SharedMemoryOptions listed = On();
  listed.allowed_uids = {65534};
  SharedMemoryRegistry trusting_all(listed);
  const TenantRegions trusting = trusting_all.For({});
  EXPECT_TRUE(trusting.RegisterSystem("r", obj.key(), 0, 64).ok());
}

TEST(SharedMemoryTest, ARegistrationLargerThanItsObjectOrOverflowingIsRefused) {
  Object obj(100);
  SharedMemoryRegistry reg_all(On(/*max_bytes=*/INT64_MAX));
  const TenantRegions reg = reg_all.For({});  // Only the object bounds the window.
  EXPECT_EQ(reg.RegisterSystem("r", obj.key(), 50, 60).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RegisterSystem("r", obj.key(), 0, 101).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RegisterSystem("r", obj.key(), UINT64_MAX, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RegisterSystem("r", obj.key(), INT64_MAX, INT64_MAX).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RegisterSystem("r", obj.key(), 1, 0).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(reg.RegisterSystem("r", obj.key(), 40, 60).ok());
  EXPECT_EQ(reg_all.registered_bytes(), 60);
}

TEST(SharedMemoryTest, EveryOffsetAndSizeIsCheckedAgainstTheRegion) {
  Object obj(100);
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  ASSERT_TRUE(reg.RegisterSystem("r", obj.key(), 10, 80).ok());
  auto region = reg.Find("r");
  ASSERT_TRUE(region.ok());
  char buf[100];
  for (const auto& [offset, size] : std::vector<std::pair<int64_t, int64_t>>{
           {-1, 4}, {0, -1}, {77, 4}, {0, 81}, {80, 1}, {INT64_MAX, 1}, {1, INT64_MAX}}) {
    const Status st = (*region)->Read(offset, size, buf, "inputs[0]");
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << offset << " " << size;
    EXPECT_THAT(st.message(), HasSubstr("inputs[0]"));
    EXPECT_EQ((*region)->Write(offset, buf, size, "outputs[0]").code(),
              StatusCode::kInvalidArgument);
  }
  ASSERT_TRUE((*region)->Read(76, 4, buf, "inputs[0]").ok());
  EXPECT_EQ(static_cast<unsigned char>(buf[0]), (10 + 76) % 251);  // The window starts at 10.
  const char out[3] = {7, 8, 9};
  ASSERT_TRUE((*region)->Write(0, out, 3, "outputs[0]").ok());
  ASSERT_TRUE((*region)->Read(0, 3, buf, "x").ok());
  EXPECT_EQ(std::string(buf, 3), std::string(out, 3));
}

TEST(SharedMemoryTest, ANameRegisteredTwiceIsRefusedWithoutTheOtherKey) {
  Object a(64, "a"), b(64, "b");
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  ASSERT_TRUE(reg.RegisterSystem("r", a.key(), 0, 64).ok());
  const Status st = reg.RegisterSystem("r", b.key(), 0, 64);
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(st.message(), Not(HasSubstr(a.key())));  // Never another caller's key.
  EXPECT_THAT(reg.Find("nope").status().message(), Not(HasSubstr(a.key())));
  EXPECT_THAT(reg.List("nope", false).status().message(), Not(HasSubstr(a.key())));
  EXPECT_EQ(reg_all.registered_bytes(), 64);
}

TEST(SharedMemoryTest, ARegionUnregisteredWhileARequestHoldsItStaysOpenUntilItIsDone) {
  Object obj(64);
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  ASSERT_TRUE(reg.RegisterSystem("r", obj.key(), 0, 64).ok());
  auto held = reg.Find("r");
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(reg.Unregister("r", false).ok());
  EXPECT_EQ(reg.Find("r").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(reg_all.registered_bytes(), 0);
  char buf[8];
  EXPECT_TRUE((*held)->Read(0, 8, buf, "inputs[0]").ok());  // The request still reads it.
  reg_all.Clear();                                          // A stop, meanwhile.
  EXPECT_TRUE((*held)->Write(0, buf, 8, "outputs[0]").ok());
}

TEST(SharedMemoryTest, AnObjectCutShortUnderneathGivesAnErrorNeverSigbus) {
  Object obj(1 << 16);
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  ASSERT_TRUE(reg.RegisterSystem("r", obj.key(), 0, 1 << 16).ok());
  auto region = reg.Find("r");
  ASSERT_TRUE(region.ok());
  obj.Truncate(100);
  std::string buf(1 << 16, '\0');
  const Status read = (*region)->Read(0, 1 << 16, buf.data(), "inputs[0]");
  EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(read.message(), HasSubstr("cut short"));
  const Status write = (*region)->Write(1000, buf.data(), 5000, "outputs[0]");
  EXPECT_EQ(write.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(obj.Size(), 100);  // Nothing was written past its end.
  EXPECT_TRUE((*region)->Read(0, 100, buf.data(), "inputs[0]").ok());  // What is left reads.
}

TEST(SharedMemoryTest, TheBudgetAndTheRegionCountBound) {
  Object a(600, "a"), b(600, "b"), c(10, "c");
  SharedMemoryRegistry reg_all(On(/*max_bytes=*/1000, /*max_regions=*/2));
  const TenantRegions reg = reg_all.For({});
  ASSERT_TRUE(reg.RegisterSystem("a", a.key(), 0, 600).ok());
  const Status full = reg.RegisterSystem("b", b.key(), 0, 600);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("--shared-memory-bytes"));
  ASSERT_TRUE(reg.RegisterSystem("c", c.key(), 0, 10).ok());
  EXPECT_EQ(reg.RegisterSystem("d", c.key(), 0, 1).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(reg.Unregister("a", false).ok());
  EXPECT_TRUE(reg.RegisterSystem("b", b.key(), 0, 600).ok());
  EXPECT_EQ(reg_all.registered_bytes(), 610);
}

TEST(SharedMemoryTest, ListAndUnregisterKeepToTheirKind) {
  Object obj(64);
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  ASSERT_TRUE(reg.RegisterSystem("r", obj.key(), 0, 64).ok());
  ASSERT_TRUE(reg.RegisterSystem("s", obj.key(), 8, 8).ok());
  EXPECT_EQ(reg.RegisterCuda("c", "handle", 0, 64).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg.List("r", true).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(reg.Unregister("", true).ok());  // No CUDA region: the system ones stay.
  auto all = reg.List("", false);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[1].key, obj.key());
  EXPECT_EQ((*all)[1].offset, 8u);
  ASSERT_TRUE(reg.Unregister("", false).ok());
  EXPECT_EQ(reg_all.regions(), 0u);
  EXPECT_TRUE(reg.Unregister("never", false).ok());  // Idempotent, as Triton's.
}

// Random registrations, unregistrations, lookups, reads, writes and truncations against a plain
// model of the registry: after every step the counts equal the model's sums, a refused operation
// changed nothing, and a held region reads and writes whatever happened to its name.
TEST(SharedMemoryTest, RandomOperationsKeepTheRegistryEqualToItsModel) {
  std::vector<std::unique_ptr<Object>> objects;
  for (int i = 0; i < 4; ++i) objects.push_back(std::make_unique<Object>(4096, "p"));
  SharedMemoryRegistry reg_all(On(/*max_bytes=*/6000, /*max_regions=*/5));
  const TenantRegions reg = reg_all.For({});
  std::map<std::string, uint64_t> model;  // name -> byte_size
  std::vector<std::shared_ptr<const SharedRegion>> held;
  std::mt19937 rng(20261127);
  for (int step = 0; step < 3000; ++step) {
    const std::string name = "n" + std::to_string(rng() % 7);
    const int op = static_cast<int>(rng() % 6);
    if (op == 0) {
      const int64_t offsets[] = {0, 100, 4000, 4095, -1};
      const int64_t off = offsets[rng() % 5];
      const uint64_t size = (rng() % 3 == 0) ? UINT64_MAX - rng() % 3 : 1 + rng() % 3000;
      const Object& obj = *objects[rng() % objects.size()];
      int64_t total = 0;
      for (const auto& [n, s] : model) total += static_cast<int64_t>(s);
      const bool fits = off >= 0 && size <= 4096 && static_cast<uint64_t>(off) + size <= 4096;
      const bool room = model.size() < 5 && total + static_cast<int64_t>(size) <= 6000;
      const Status st = reg.RegisterSystem(name, obj.key(), static_cast<uint64_t>(off), size);
      const bool want = fits && room && !model.count(name);
      ASSERT_EQ(st.ok(), want) << step << " " << st.message();
      if (st.ok()) model[name] = size;
    } else if (op == 1) {
      const bool all = rng() % 10 == 0;
      ASSERT_TRUE(reg.Unregister(all ? "" : name, false).ok());
      if (all) {
        model.clear();
      } else {
        model.erase(name);
      }
    } else if (op == 2) {
      auto found = reg.Find(name);
      ASSERT_EQ(found.ok(), model.count(name) > 0) << step;
      if (found.ok() && held.size() < 8) held.push_back(*found);
    } else if (op == 3 && !held.empty()) {
      const auto& r = held[rng() % held.size()];
      char buf[64];
      const int64_t at = static_cast<int64_t>(rng() % (r->info().byte_size + 10));
      const Status st = r->Read(at, 64, buf, "inputs[0]");
      if (at + 64 > static_cast<int64_t>(r->info().byte_size))
        ASSERT_EQ(st.code(), StatusCode::kInvalidArgument);
    } else if (op == 4 && !held.empty()) {
      held.erase(held.begin());
    }
    int64_t total = 0;
    for (const auto& [n, s] : model) total += static_cast<int64_t>(s);
    ASSERT_EQ(reg_all.registered_bytes(), total) << step;
    ASSERT_EQ(reg_all.regions(), model.size()) << step;
    ASSERT_GE(reg_all.registered_bytes(), 0);
  }
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

RegionCaller Tenant(const std::string& name, int64_t max_bytes = 0, std::string prefix = "",
                    bool local = true) {
  RegionTerms terms;
  terms.max_bytes = max_bytes;
  terms.key_prefix = std::move(prefix);
  return RegionCaller{name, std::move(terms), local};
}

// What a status says with the name it names swapped for "<>": another tenant's name must read
// exactly as an unknown one.
std::string Unnamed(const Status& st, const std::string& name) {
  std::string m = st.message();
  for (size_t at; (at = m.find("'" + name + "'")) != std::string::npos;)
    m.replace(at, name.size() + 2, "<>");
  return std::to_string(static_cast<int>(st.code())) + " " + m;
}

TEST(SharedMemoryTenantsTest, AnotherTenantsNameIsNotFoundExactlyAsAnUnknownOne) {
  Object obj(4096), theirs(4096);
  SharedMemoryRegistry registry(On());
  const TenantRegions a = registry.For(Tenant("a")), b = registry.For(Tenant("b"));
  ASSERT_TRUE(a.RegisterSystem("r", obj.key(), 0, 4096).ok());
  EXPECT_TRUE(b.List("", false)->empty());
  EXPECT_EQ(Unnamed(b.List("r", false).status(), "r"), Unnamed(b.List("q", false).status(), "q"));
  EXPECT_EQ(b.List("r", false).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Unnamed(b.Find("r").status(), "r"), Unnamed(b.Find("q").status(), "q"));
  // b's "every region" and b's "r" are b's; a keeps its own; b may use the same name.
  EXPECT_TRUE(b.Unregister("", false).ok());
  EXPECT_TRUE(b.Unregister("r", false).ok());
  ASSERT_TRUE(a.Find("r").ok());
  ASSERT_TRUE(b.RegisterSystem("r", theirs.key(), 0, 4096).ok());
  EXPECT_EQ(a.List("r", false)->at(0).key, obj.key());
  EXPECT_EQ(b.List("r", false)->at(0).key, theirs.key());
  EXPECT_EQ(registry.regions(), 2u);
  EXPECT_EQ(registry.registered_bytes(), 8192);
  EXPECT_EQ(a.RegisterSystem("r", obj.key(), 0, 16).code(), StatusCode::kAlreadyExists);
}

TEST(SharedMemoryTenantsTest, TheCapsNameOnlyTheCallersOwnBytes) {
  Object obj(1 << 20);
  SharedMemoryRegistry registry(On(/*max_bytes=*/600000));
  const TenantRegions a = registry.For(Tenant("a", /*max_bytes=*/300000));
  const TenantRegions b = registry.For(Tenant("b", /*max_bytes=*/400000));
  ASSERT_TRUE(a.RegisterSystem("x", obj.key(), 0, 250000).ok());
  // a's own cap: a's bytes named.
  Status st = a.RegisterSystem("y", obj.key(), 0, 60000);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("shared_memory_max_bytes"));
  EXPECT_THAT(st.message(), HasSubstr("250000 this tenant"));
  // The server's budget, reached by a's bytes: b learns nothing of them.
  ASSERT_TRUE(b.RegisterSystem("x", obj.key(), 0, 300000).ok());
  st = b.RegisterSystem("y", obj.key(), 0, 90000);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("--shared-memory-bytes"));
  EXPECT_THAT(st.message(), Not(HasSubstr("250000")));
  EXPECT_THAT(st.message(), Not(HasSubstr("550000")));
  // Past the tenant's own cap (300,000 held + 200,000 > 400,000): its cap, the others unaffected.
  st = b.RegisterSystem("z", obj.key(), 0, 200000);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("shared_memory_max_bytes"));
  EXPECT_TRUE(a.RegisterSystem("small", obj.key(), 0, 40000).ok());
}

TEST(SharedMemoryTenantsTest, AKeyOutsideTheTenantsPrefixIsRefused) {
  Object obj(4096);  // Its key: "/attnserve-shm-test-PID-N".
  SharedMemoryRegistry registry(On());
  const std::string name = obj.key().substr(1);
  const TenantRegions mine = registry.For(Tenant("a", 0, name.substr(0, 12)));
  const TenantRegions other = registry.For(Tenant("b", 0, "b."));
  EXPECT_TRUE(mine.RegisterSystem("r", obj.key(), 0, 4096).ok());
  const Status st = other.RegisterSystem("r", obj.key(), 0, 4096);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("'b.'"));
  EXPECT_THAT(st.message(), HasSubstr("shared_memory_key_prefix"));
}

TEST(SharedMemoryTenantsTest, ACallerOffThisHostRegistersOnlyWhenAllowed) {
  Object obj(4096);
  SharedMemoryRegistry closed(On());
  const Status st =
      closed.For(Tenant("a", 0, "", /*local=*/false)).RegisterSystem("r", obj.key(), 0, 4096);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("--shared-memory-remote-peers"));
  EXPECT_EQ(closed.regions(), 0u);
  SharedMemoryOptions o = On();
  o.remote_peers = true;
  SharedMemoryRegistry open(o);
  EXPECT_TRUE(open.For(Tenant("a", 0, "", false)).RegisterSystem("r", obj.key(), 0, 4096).ok());
}

// The review of issue 67: a tenant's region, registered by its caller on this host, was used by
// the same tenant's calls from another host (the object is on this one).
TEST(SharedMemoryTenantsTest, ARegionIsUsedFromThisHostOnlyUnlessAllowed) {
  Object obj(4096);
  SharedMemoryRegistry closed(On());
  ASSERT_TRUE(closed.For(Tenant("a", 0, "")).RegisterSystem("r", obj.key(), 0, 4096).ok());
  EXPECT_TRUE(closed.For(Tenant("a", 0, "")).Find("r").ok());
  const auto far = closed.For(Tenant("a", 0, "", /*local=*/false)).Find("r");
  EXPECT_EQ(far.status().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(far.status().message(), HasSubstr("--shared-memory-remote-peers"));
  SharedMemoryOptions o = On();
  o.remote_peers = true;
  SharedMemoryRegistry open(o);
  ASSERT_TRUE(open.For(Tenant("a", 0, "")).RegisterSystem("r", obj.key(), 0, 4096).ok());
  EXPECT_TRUE(open.For(Tenant("a", 0, "", false)).Find("r").ok());
}

// The review of issue 67: a server running as root opened a 0444 object for writing (root passes
// every mode) and wrote answers into it. The owner's bits decide: no write bit, read-only; no
// read bit, refused.
TEST(SharedMemoryTest, TheOwnersModeBitsDecideWhatTheServerMayDo) {
  Object read_only(64), unreadable(64);
  ASSERT_EQ(::chmod(("/dev/shm" + read_only.key()).c_str(), 0444), 0);
  ASSERT_EQ(::chmod(("/dev/shm" + unreadable.key()).c_str(), 0200), 0);
  SharedMemoryRegistry reg_all(On());
  const TenantRegions reg = reg_all.For({});
  ASSERT_TRUE(reg.RegisterSystem("ro", read_only.key(), 0, 64).ok());
  auto region = reg.Find("ro");
  ASSERT_TRUE(region.ok());
  char bytes[8] = {};
  EXPECT_TRUE((*region)->Read(0, 8, bytes, "in").ok());
  EXPECT_EQ(bytes[3], 3);
  EXPECT_FALSE((*region)->info().writable);
  const Status refused = (*region)->CheckWritable("outputs[0]");
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("outputs[0]: shared memory region 'ro' is read-only"));
  const Status written = (*region)->Write(0, "xxxxxxxx", 8, "attn_output");
  EXPECT_EQ(written.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(written.message(), HasSubstr("attn_output"));
  EXPECT_TRUE((*region)->Read(0, 8, bytes, "in").ok());
  EXPECT_EQ(bytes[3], 3);  // Unchanged.
  const Status st = reg.RegisterSystem("wo", unreadable.key(), 0, 64);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("mode 200"));
}

// A loopback connection to a listener here, made by a child process running as `uid`: its peer
// name as the server sees it. The child holds it open until the object is destroyed.
class LoopbackCaller {
 public:
  explicit LoopbackCaller(uid_t uid) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    EXPECT_EQ(::listen(listener_, 1), 0);
    socklen_t len = sizeof at;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&at), &len);
    int hold[2];
    EXPECT_EQ(::pipe(hold), 0);
    child_ = ::fork();
    if (child_ == 0) {
      ::close(hold[1]);
      if (::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(1);
      const int s = ::socket(AF_INET, SOCK_STREAM, 0);
      if (::connect(s, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0) ::_exit(2);
      char c;
      while (::read(hold[0], &c, 1) < 0 && errno == EINTR) {
      }
      ::_exit(0);
    }
    ::close(hold[0]);
    hold_ = hold[1];
    sockaddr_in peer{};
    len = sizeof peer;
    accepted_ = ::accept(listener_, reinterpret_cast<sockaddr*>(&peer), &len);
    EXPECT_GE(accepted_, 0);
    EXPECT_TRUE(ConnectionEnds::Get().Add(accepted_));  // As the server's listeners record it.
    uri_ = PeerUriOf(reinterpret_cast<sockaddr*>(&peer));
  }
  ~LoopbackCaller() {
    ConnectionEnds::Get().Remove(accepted_);
    ::close(hold_);
    int status = 0;
    ::waitpid(child_, &status, 0);
    ::close(accepted_);
    ::close(listener_);
  }
  const std::string& uri() const { return uri_; }

 private:
  int listener_ = -1, accepted_ = -1, hold_ = -1;
  pid_t child_ = -1;
  std::string uri_;
};

// The review of issue 67: as root, the server registered any root-owned object (say
// /libpod_lock) for any caller on its host, and wrote answers into it. A loopback caller now
// registers only objects of its own uid (its socket's owner); the server's and
// --shared-memory-uids' rule still holds besides.
TEST(SharedMemoryTest, ALoopbackCallerRegistersOnlyObjectsOfItsOwnUid) {
  if (::geteuid() != 0)
    GTEST_SKIP() << "needs root: to run a caller and own an object as uid 65534";
  Object roots(64), nobodys(64);
  ASSERT_EQ(::chown(("/dev/shm" + nobodys.key()).c_str(), 65534, 65534), 0);
  SharedMemoryOptions o = On();
  o.allowed_uids = {65534};
  SharedMemoryRegistry registry(o);
  const LoopbackCaller nobody(65534), root(0);
  RegionCaller as_nobody, as_root;
  as_nobody.peer_uri = nobody.uri();
  as_root.peer_uri = root.uri();
  const Status stolen = registry.For(as_nobody).RegisterSystem("r", roots.key(), 0, 64);
  EXPECT_EQ(stolen.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(stolen.message(),
              HasSubstr("belongs to uid 0, and this call came from a process of uid 65534"));
  const Status theirs = registry.For(as_root).RegisterSystem("r", nobodys.key(), 0, 64);
  EXPECT_EQ(theirs.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(theirs.message(), HasSubstr("uid 65534, and this call came from a process of uid 0"));
  EXPECT_EQ(registry.regions(), 0u);
  EXPECT_TRUE(registry.For(as_nobody).RegisterSystem("n", nobodys.key(), 0, 64).ok());
  EXPECT_TRUE(registry.For(as_root).RegisterSystem("r", roots.key(), 0, 64).ok());
  // A loopback peer no socket here matches (gone, or never there): not known, refused.
  RegionCaller unknown;
  unknown.peer_uri = "ipv4:127.0.0.1:1";
  const Status st = registry.For(unknown).RegisterSystem("u", roots.key(), 0, 64);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("not known"));
}

// Random registrations, unregistrations (one name or all), finds and reads from three tenants with
// caps: after every step each tenant sees exactly its own model, never another's name, and the
// registry's totals are the models' sums.
TEST(SharedMemoryTenantsTest, RandomOperationsFromSeveralTenantsKeepEachItsOwn) {
  std::vector<std::unique_ptr<Object>> objects;
  for (int i = 0; i < 3; ++i) objects.push_back(std::make_unique<Object>(4096, "t"));
  SharedMemoryRegistry registry(On(/*max_bytes=*/9000, /*max_regions=*/8));
  const std::vector<std::string> names = {"a", "b", "c"};
  const int64_t caps[] = {0, 5000, 3000};
  std::vector<TenantRegions> views;
  for (size_t t = 0; t < names.size(); ++t)
    views.push_back(registry.For(Tenant(names[t], caps[t])));
  std::vector<std::map<std::string, uint64_t>> model(names.size());
  std::mt19937 rng(4801);
  const auto sum = [](const std::map<std::string, uint64_t>& m) {
    int64_t s = 0;
    for (const auto& [n, b] : m) s += static_cast<int64_t>(b);
    return s;
  };
  for (int step = 0; step < 3000; ++step) {
    const size_t t = rng() % names.size();
    const std::string name = "n" + std::to_string(rng() % 4);
    const uint64_t sizes[] = {1, 100, 2000, 4096, 4097, UINT64_MAX, uint64_t{INT64_MAX}, 0};
    const uint64_t size = sizes[rng() % 8];
    int64_t total = 0, count = 0;
    for (const auto& m : model) total += sum(m), count += static_cast<int64_t>(m.size());
    switch (rng() % 4) {
      case 0: {
        const Status st = views[t].RegisterSystem(name, objects[rng() % 3]->key(), 0, size);
        const bool want = size >= 1 && size <= 4096 && !model[t].count(name) && count < 8 &&
                          total + static_cast<int64_t>(size) <= 9000 &&
                          (caps[t] == 0 || sum(model[t]) + static_cast<int64_t>(size) <= caps[t]);
        ASSERT_EQ(st.ok(), want) << step << " " << st.message();
        if (st.ok()) model[t][name] = size;
        break;
      }
      case 1: {
        const bool all = rng() % 5 == 0;
        ASSERT_TRUE(views[t].Unregister(all ? "" : name, false).ok());
        if (all)
          model[t].clear();
        else
          model[t].erase(name);
        break;
      }
      default: {
        const auto found = views[t].Find(name);
        ASSERT_EQ(found.ok(), model[t].count(name) > 0) << step;
        if (!found.ok())
          ASSERT_EQ(Unnamed(found.status(), name), Unnamed(views[t].Find("zz").status(), "zz"));
      }
    }
    total = count = 0;
    for (size_t u = 0; u < names.size(); ++u) {
      const auto listed = views[u].List("", false);
      ASSERT_TRUE(listed.ok());
      std::map<std::string, uint64_t> seen;
      for (const RegionInfo& r : *listed) seen[r.name] = r.byte_size;
      ASSERT_EQ(seen, model[u]) << step << " tenant " << names[u];
      total += sum(model[u]);
      count += static_cast<int64_t>(model[u].size());
    }
    ASSERT_EQ(registry.registered_bytes(), total) << step;
    ASSERT_EQ(static_cast<int64_t>(registry.regions()), count) << step;
  }
}

}  // namespace
}  // namespace attnserve
