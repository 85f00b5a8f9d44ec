// attnserve.v1 with tensors in shared memory, through the C++ client: a real server in-process
// (--allow-shared-memory), regions made with attnserve::SharedMemoryRegion. Every answer is byte
// for byte the in-message answer to the same request (unary, stream, a memory made from a region, a
// session step), and the refusals name the field.
#include "attnserve/shared_memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <future>
#include <random>

#include "attnserve/client.h"
#include "server/process/server.h"
#include "tests/integration/test_support.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::TargetOf;

std::string Key(const std::string& tag) {
  return "/attnserve-v1-shm-" + std::to_string(::getpid()) + "-" + tag;
}

std::unique_ptr<Server> Start(bool allowed) {
  ServerOptions o;
  o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
  o.address = "127.0.0.1:0";
  o.metrics_address = "";
  o.batcher.workers = 2;
  o.shared_memory.allowed = allowed;
  auto s = Server::Start(o);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return std::move(s).value();
}

TEST(SharedMemoryV1Test, TensorsInRegionsAnswerTheInMessageBytes) {
  auto server = Start(true);
  Client client(TargetOf(*server));
  std::mt19937 rng(5);
  const Tensor q = RandomTensor(rng, {2, 6, 512}), k = RandomTensor(rng, {2, 9, 512}),
               v = RandomTensor(rng, {2, 9, 512});
  auto in = SharedMemoryRegion::Create(Key("in"), 1 << 20);
  auto out = SharedMemoryRegion::Create(Key("out"), 1 << 16);
  ASSERT_TRUE(client.RegisterSharedMemory("in", in->key(), 0, in->size()).ok());
  ASSERT_TRUE(client.RegisterSharedMemory("out", out->key(), 0, out->size()).ok());
  std::vector<SharedMemoryRegionInfo> regions;
  ASSERT_TRUE(client.SharedMemoryStatus("", &regions).ok());
  ASSERT_EQ(regions.size(), 2u);
  EXPECT_EQ(regions[0].key, in->key());

  AttendRequest plain;
  plain.query = q;
  plain.key = k;
  plain.value = v;
  AttendResult want;
  ASSERT_TRUE(client.Attend(plain, &want).ok());

  AttendRequest shared;
  shared.query = in->Put(q, "in", 0);
  shared.key = in->Put(k, "in", q.data.size());
  shared.value = in->Put(v, "in", q.data.size() + k.data.size());
  shared.output_shared_memory = SharedMemoryRef{"out", 128, static_cast<int64_t>(q.data.size())};
  AttendResult got;
  const CallStatus st = client.Attend(shared, &got);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(got.output.data.empty());
  EXPECT_EQ(got.output.shape, (std::vector<int64_t>{2, 6, 512}));
  EXPECT_EQ(out->Get(DataType::kFloat32, {2, 6, 512}, 128).data, want.output.data);

  // The output in the message, the inputs in the region; on a stream too.
  shared.output_shared_memory.reset();
  ASSERT_TRUE(client.Attend(shared, &got).ok());
  EXPECT_EQ(got.output.data, want.output.data);
  std::promise<std::string> streamed;
  auto stream = client.OpenStream([&](CallStatus s, AttendResult r) {
    streamed.set_value(s.ok() ? r.output.data : s.ToString());
  });
  ASSERT_TRUE(stream->Send(shared));
  EXPECT_EQ(streamed.get_future().get(), want.output.data);
  EXPECT_TRUE(stream->Finish().ok());

  // A memory made from keys and values in the region: the same as one made from the message.
  MemoryRequest mem_plain;
  mem_plain.key = k;
  mem_plain.value = v;
  MemoryRequest mem_shared;
  mem_shared.key = *shared.key;
  mem_shared.value = *shared.value;
  KvInfo a, b;
  ASSERT_TRUE(client.CreateMemory(mem_plain, &a).ok());
  const CallStatus made = client.CreateMemory(mem_shared, &b);
  ASSERT_TRUE(made.ok()) << made.ToString();
  AttendRequest qa, qb;
  qa.memory = a.handle;
  qb.memory = b.handle;
  qa.query = q;
  qb.query = in->Put(q, "in", 0);
  AttendResult ra, rb;
  ASSERT_TRUE(client.Attend(qa, &ra).ok());
  ASSERT_TRUE(client.Attend(qb, &rb).ok());
  EXPECT_EQ(ra.output.data, rb.output.data);

  // A session step from the region: the same as from the message.
  KvInfo s1, s2;
  ASSERT_TRUE(client.OpenSession("demo", 2, &s1).ok());
  ASSERT_TRUE(client.OpenSession("demo", 2, &s2).ok());
  AttendRequest step1, step2;
  step1.session = s1.handle;
  step2.session = s2.handle;
  step1.query = q;
  step2.query = in->Put(q, "in", 0);
  ASSERT_TRUE(client.Attend(step1, &ra).ok());
  ASSERT_TRUE(client.Attend(step2, &rb).ok());
  EXPECT_EQ(ra.output.data, rb.output.data);

  // Refusals, each naming the field.
  struct Case {
    std::function<void(AttendRequest*)> change;
    int code;
    const char* says;
  };
  const Case cases[] = {
      {[](AttendRequest* r) { r->query.shared_memory->region = "nope"; }, 5,
       "region 'nope' is not registered"},
      {[](AttendRequest* r) { r->query.shared_memory->offset = (1 << 20) - 8; }, 3,
       "query.shared_memory: offset"},
      {[](AttendRequest* r) {
         r->output_shared_memory = SharedMemoryRef{"out", 0, 100};
       },
       3, "output_shared_memory (region 'out'): 100 bytes given for the output, which needs 24576"},
      {[](AttendRequest* r) {
         r->output_shared_memory = SharedMemoryRef{"out", 65000, 1000};
       },
       3, "output_shared_memory.shared_memory: offset 65000"},
  };
  for (const Case& c : cases) {
    AttendRequest r = shared;
    c.change(&r);
    const CallStatus s = client.Attend(r, &got);
    EXPECT_EQ(s.code, c.code) << c.says << ": " << s.ToString();
    EXPECT_THAT(s.message, HasSubstr(c.says));
    EXPECT_THAT(s.message, ::testing::Not(HasSubstr(in->key())));
  }
  EXPECT_EQ(client.RegisterSharedMemory("in", out->key(), 0, 8).code, 6);  // ALREADY_EXISTS
  ASSERT_TRUE(client.UnregisterSharedMemory("").ok());
  EXPECT_EQ(client.Attend(shared, &got).code, 5);
  ASSERT_TRUE(client.SharedMemoryStatus("", &regions).ok());
  EXPECT_TRUE(regions.empty());
}

TEST(SharedMemoryV1Test, OffUnlessAllowed) {
  auto server = Start(false);
  Client client(TargetOf(*server));
  auto region = SharedMemoryRegion::Create(Key("off"), 4096);
  const CallStatus st = client.RegisterSharedMemory("r", region->key(), 0, 4096);
  EXPECT_EQ(st.code, 9);  // FAILED_PRECONDITION
  EXPECT_THAT(st.message, HasSubstr("--allow-shared-memory"));
  std::mt19937 rng(1);
  AttendRequest r;
  r.query = region->Put(RandomTensor(rng, {1, 2, 512}), "r");
  AttendResult res;
  EXPECT_EQ(client.Attend(r, &res).code, 9);
}

}  // namespace
}  // namespace attnserve
