// How tensors travel from the C++ client: in the model's 16-bit dtype by default (answers widened
// back to float32 here), as given when asked, and over a pool of connections.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <future>
#include <random>
#include <set>
#include <sstream>

#include "attnserve/client.h"
#include "attnserve/half.h"
#include "server/process/server.h"
#include "tests/integration/test_support.h"

namespace attnserve {
namespace {

using testing::RandomTensor;
using testing::TargetOf;

std::unique_ptr<Server> Start(DType dtype) {
  ServerOptions o;
  o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
  o.address = "127.0.0.1:0";
  o.metrics_address = "";
  o.batcher.workers = 2;
  o.compute_dtype = dtype;
  auto s = Server::Start(o);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return std::move(s).value();
}

Tensor ToBFloat16(const Tensor& t) {
  std::vector<float> v = t.ToFloats();
  return Tensor::BFloat16(t.shape, v);
}

// A bfloat16 model: a float32 query travels in bfloat16 and its answer comes back widened, the
// same values as sending bfloat16 by hand; kAsGiven sends float32 and gets float32.
TEST(TransportTest, TheModelsSixteenBitWireByDefault) {
  auto server = Start(DType::kBFloat16);
  ClientOptions model_wire = TargetOf(*server);
  ClientOptions as_given = TargetOf(*server);
  as_given.wire_dtype = ClientOptions::WireDtype::kAsGiven;
  Client client(model_wire), raw(as_given);
  std::mt19937 rng(3);
  AttendRequest r;
  r.query = RandomTensor(rng, {2, 5, 512});
  r.key = RandomTensor(rng, {2, 7, 512});
  r.value = RandomTensor(rng, {2, 7, 512});
  AttendResult got;
  ASSERT_TRUE(client.Attend(r, &got).ok());
  EXPECT_EQ(got.output.dtype, DataType::kFloat32);
  AttendRequest by_hand = r;
  by_hand.query = ToBFloat16(r.query);
  by_hand.key = ToBFloat16(*r.key);
  by_hand.value = ToBFloat16(*r.value);
  AttendResult want;
  ASSERT_TRUE(raw.Attend(by_hand, &want).ok());
  ASSERT_EQ(want.output.dtype, DataType::kBFloat16);
  EXPECT_EQ(got.output.ToFloats(), want.output.ToFloats());  // Widened exactly.
  AttendResult f32;
  ASSERT_TRUE(raw.Attend(r, &f32).ok());
  EXPECT_EQ(f32.output.dtype, DataType::kFloat32);  // Opted out: float32 each way.
  // On a stream too, and for a memory's keys and values.
  std::promise<AttendResult> streamed;
  auto stream = client.OpenStream([&](CallStatus s, AttendResult a) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    streamed.set_value(std::move(a));
  });
  r.request_id = 9;
  ASSERT_TRUE(stream->Send(r));
  const AttendResult s = streamed.get_future().get();
  EXPECT_EQ(s.output.dtype, DataType::kFloat32);
  EXPECT_EQ(s.output.ToFloats(), want.output.ToFloats());
  EXPECT_TRUE(stream->Finish().ok());
  MemoryRequest m;
  m.key = *r.key;
  m.value = *r.value;
  KvInfo mem;
  ASSERT_TRUE(client.CreateMemory(m, &mem).ok());
  AttendRequest q;
  q.memory = mem.handle;
  q.query = r.query;
  AttendResult viam;
  ASSERT_TRUE(client.Attend(q, &viam).ok());
  EXPECT_EQ(viam.output.dtype, DataType::kFloat32);
}

// A float32 model: nothing to narrow, float32 each way.
TEST(TransportTest, AFloat32ModelKeepsFloat32) {
  auto server = Start(DType::kFloat32);
  Client client(TargetOf(*server));
  std::mt19937 rng(4);
  AttendRequest r;
  r.query = RandomTensor(rng, {1, 3, 512});
  AttendResult got;
  ASSERT_TRUE(client.Attend(r, &got).ok());
  EXPECT_EQ(got.output.dtype, DataType::kFloat32);
}

// Established TCP connections to `port` on this host (gRPC's client sockets may be IPv6 ones with
// a v4-mapped address: both tables).
int ConnectionsTo(int port) {
  int n = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream tcp(table);
    std::string line;
    std::getline(tcp, line);
    while (std::getline(tcp, line)) {
      std::istringstream in(line);
      std::string slot, local, remote, state;
      in >> slot >> local >> remote >> state;
      const int remote_port = std::stoi(remote.substr(remote.find(':') + 1), nullptr, 16);
      if (remote_port == port && state == "01") ++n;
    }
  }
  return n;
}

TEST(TransportTest, ConcurrentCallsSpreadOverThePoolsConnections) {
  auto server = Start(DType::kFloat32);
  ClientOptions o = TargetOf(*server);
  o.connections = 4;
  Client client(o);
  std::mt19937 rng(5);
  AttendRequest r;
  r.query = RandomTensor(rng, {1, 4, 512});
  std::vector<std::future<CallStatus>> calls;
  for (int i = 0; i < 16; ++i) {
    calls.push_back(std::async(std::launch::async, [&] {
      AttendResult res;
      return client.Attend(r, &res);
    }));
  }
  for (auto& c : calls) EXPECT_TRUE(c.get().ok());
  EXPECT_EQ(ConnectionsTo(server->port()), 4);
  // The first server goes before the second starts: gRPC's callback threads are the process's,
  // shared by the servers alive; threads the first one started would take the second one's calls,
  // its handlers handed over inside libgrpc++, unseen by ThreadSanitizer (a false race on the
  // generated handler's std::function, twice in CI's tsan runs of 2026-11-28).
  server.reset();
  auto other = Start(DType::kFloat32);  // A fresh server: gRPC shares equal channels' connections.
  ClientOptions one = TargetOf(*other);
  one.connections = 1;
  Client single(one);
  calls.clear();
  for (int i = 0; i < 16; ++i) {
    calls.push_back(std::async(std::launch::async, [&] {
      AttendResult res;
      return single.Attend(r, &res);
    }));
  }
  for (auto& c : calls) EXPECT_TRUE(c.get().ok());
  EXPECT_EQ(ConnectionsTo(other->port()), 1);
}

}  // namespace
}  // namespace attnserve
