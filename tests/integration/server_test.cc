// The real server in-process on 127.0.0.1:0, the real C++ client over the real wire, and a real
// /metrics scrape. Servers are few and shared (each start loads the model and binds its ports).
#include "server/process/server.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "attnserve/client.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/grpc/grpc_status.h"
#include "server/pipeline/batcher.h"
#include "tests/integration/test_support.h"
#include "tests/lib/test_paths.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

using testing::Counter;
using testing::HttpGet;
using testing::RandomTensor;
using testing::Sample;
using testing::TargetOf;
using testing::WaitUntil;

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions o;
    o.http.address = "127.0.0.1:0";  // The shared server serves HTTP too (stopped with it).
    o.address = "127.0.0.1:0";
    o.metrics_address = "127.0.0.1:0";
    o.batcher.workers = 2;
    auto s = Server::Start(o);
    ASSERT_TRUE(s.ok()) << s.status().message();
    server_ = std::move(s).value().release();
    client_ = new Client(TargetOf(*server_));
  }
  static void TearDownTestSuite() {
    delete client_;
    delete server_;
  }

  AttendRequest Request(int64_t b, int64_t lq, int64_t lk = 0, uint32_t seed = 1) {
    std::mt19937 rng(seed);
    AttendRequest r;
    r.model = "demo";
    r.query = RandomTensor(rng, {b, lq, 512});
    if (lk) {
      r.key = RandomTensor(rng, {b, lk, 512});
      r.value = RandomTensor(rng, {b, lk, 512});
    }
    return r;
  }

  static Server* server_;
  static Client* client_;
};
Server* ServerTest::server_ = nullptr;
Client* ServerTest::client_ = nullptr;

TEST_F(ServerTest, ListsAndDescribesModels) {
  std::vector<ModelInfo> models;
  ASSERT_TRUE(client_->ListModels(&models).ok());
  ASSERT_EQ(models.size(), 1u);
  EXPECT_EQ(models[0].name, "demo");
  EXPECT_EQ(models[0].embed_dim, 512);
  EXPECT_EQ(models[0].num_heads, 8);
  EXPECT_EQ(models[0].device, "cpu");
  ModelInfo m;
  CallStatus s = client_->GetModel("nope", &m);
  EXPECT_EQ(s.code, 5);
  EXPECT_THAT(s.message, HasSubstr("name: 'nope' is not loaded; available: demo"));
}

TEST_F(ServerTest, AttendsSelfAndCrossDeterministically) {
  AttendRequest r = Request(2, 7, 0, 3);
  r.request_id = 42;
  r.attn_weights = AttnWeights::kPerHead;
  AttendResult a, b;
  ASSERT_TRUE(client_->Attend(r, &a).ok());
  ASSERT_TRUE(client_->Attend(r, &b).ok());
  EXPECT_EQ(a.output.shape, (std::vector<int64_t>{2, 7, 512}));
  EXPECT_EQ(a.output.data, b.output.data);
  EXPECT_EQ(a.request_id, 42u);
  EXPECT_EQ(a.model, "demo");
  ASSERT_TRUE(a.attn_weights.has_value());
  EXPECT_EQ(a.attn_weights->shape, (std::vector<int64_t>{2, 8, 7, 7}));
  double row = 0;
  for (int j = 0; j < 7; ++j) row += a.attn_weights->ToFloats()[j];
  EXPECT_NEAR(row, 1.0, 1e-5);
  EXPECT_GT(a.compute_seconds, 0);

  AttendResult c;
  ASSERT_TRUE(client_->Attend(Request(3, 4, 9), &c).ok());
  EXPECT_EQ(c.output.shape, (std::vector<int64_t>{3, 4, 512}));
  for (float x : c.output.ToFloats()) ASSERT_TRUE(std::isfinite(x));
}

// `got` holds `want`'s values to float32 rounding: within 1e-5 of their scale.
bool CloseTo(const Tensor& got, const std::vector<float>& want) {
  const std::vector<float> g = got.ToFloats();
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size() && i < g.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(g[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  return g.size() == want.size() && scale > 0.1 && err <= 1e-5 * scale;
}

// The C++ client's memories and sessions: a memory answers what key and value on the wire answer;
// session steps answer the rows of one causal self-attention over their concatenation (same server,
// same model; float32, 1e-5 of the output's scale).
TEST_F(ServerTest, ClientMemoriesAndSessionsEqualTheirOneCallForms) {
  const AttendRequest cross = Request(2, 5, 12, 9);
  MemoryRequest m;
  m.key = *cross.key;
  m.value = *cross.value;
  KvInfo memory;
  ASSERT_TRUE(client_->CreateMemory(m, &memory).ok());
  EXPECT_EQ(memory.handle.size(), 32u);
  EXPECT_EQ(memory.length, 12);
  EXPECT_EQ(memory.batch, 2);
  AttendResult wire, kept;
  ASSERT_TRUE(client_->Attend(cross, &wire).ok());
  AttendRequest with_memory;
  with_memory.query = cross.query;
  with_memory.memory = memory.handle;
  ASSERT_TRUE(client_->Attend(with_memory, &kept).ok());
  EXPECT_TRUE(CloseTo(kept.output, wire.output.ToFloats()));
  ASSERT_TRUE(client_->DeleteMemory(memory.handle).ok());
  CallStatus gone = client_->Attend(with_memory, &kept);
  EXPECT_EQ(gone.code, 5);
  EXPECT_THAT(gone.message, HasSubstr("deleted"));

  // One causal call over 9 tokens, then the same tokens as steps of 4, 1, 3, 1.
  AttendRequest whole = Request(1, 9, 0, 10);
  whole.is_causal = true;
  AttendResult all;
  ASSERT_TRUE(client_->Attend(whole, &all).ok());
  const std::vector<float> x = whole.query.ToFloats(), y = all.output.ToFloats();
  KvInfo session;
  ASSERT_TRUE(client_->OpenSession("demo", 1, &session).ok());
  int64_t t0 = 0;
  for (int64_t t : {4, 1, 3, 1}) {
    AttendRequest step;
    step.session = session.handle;
    step.session_length = t0;
    step.query = Tensor::Float32(
        {1, t, 512}, std::vector<float>(x.begin() + t0 * 512, x.begin() + (t0 + t) * 512));
    AttendResult r;
    const CallStatus s = client_->Attend(step, &r);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(r.session_length, t0 + t);
    EXPECT_TRUE(
        CloseTo(r.output, std::vector<float>(y.begin() + t0 * 512, y.begin() + (t0 + t) * 512)))
        << "step at " << t0;
    t0 += t;
  }
  ASSERT_TRUE(client_->CloseSession(session.handle).ok());
  EXPECT_EQ(client_->CloseSession(session.handle).code, 5);
}

// The C++ client's batched step: sessions stepped together in one call (unary and on a stream)
// answer, entry by entry, the rows of one causal self-attention over each session's tokens
// (float32, 1e-5 of the output's scale); an entry naming a closed session answers NOT_FOUND alone.
TEST_F(ServerTest, ClientBatchedStepsEqualEachSessionsOwnCausalCall) {
  constexpr int kSessions = 3;
  std::vector<std::vector<float>> x, y;  // Each session's 6 tokens, and their causal answer.
  std::vector<KvInfo> sessions(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    AttendRequest whole = Request(1, 6, 0, 20 + i);
    whole.is_causal = true;
    AttendResult all;
    ASSERT_TRUE(client_->Attend(whole, &all).ok());
    x.push_back(whole.query.ToFloats());
    y.push_back(all.output.ToFloats());
    ASSERT_TRUE(client_->OpenSession("demo", 1, &sessions[i]).ok());
  }
  KvInfo closed;
  ASSERT_TRUE(client_->OpenSession("demo", 1, &closed).ok());
  ASSERT_TRUE(client_->CloseSession(closed.handle).ok());
  const auto rows = [](const std::vector<float>& v, int64_t from, int64_t n) {
    return std::vector<float>(v.begin() + from * 512, v.begin() + (from + n) * 512);
  };
  // Round 1 (unary): 3, 1 and 2 tokens, and the closed session. Round 2 (on a stream): the rest.
  const std::vector<int64_t> first = {3, 1, 2};
  AttendRequest call;
  for (int i = 0; i < kSessions; ++i) {
    Step step;
    step.session = sessions[i].handle;
    step.session_length = 0;
    step.query = Tensor::Float32({1, first[i], 512}, rows(x[i], 0, first[i]));
    call.steps.push_back(step);
  }
  Step gone;
  gone.session = closed.handle;
  gone.query = Tensor::Float32({1, 1, 512}, rows(x[0], 0, 1));
  call.steps.push_back(gone);
  AttendResult r;
  const CallStatus st = client_->Attend(call, &r);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(r.steps.size(), 4u);
  for (int i = 0; i < kSessions; ++i) {
    ASSERT_TRUE(r.steps[i].status.ok()) << r.steps[i].status.message;
    EXPECT_EQ(r.steps[i].session_length, first[i]);
    EXPECT_TRUE(CloseTo(r.steps[i].output, rows(y[i], 0, first[i]))) << "entry " << i;
  }
  EXPECT_EQ(r.steps[3].status.code, 5);
  EXPECT_THAT(r.steps[3].status.message, HasSubstr("closed"));
  EXPECT_TRUE(r.steps[3].output.data.empty());

  std::promise<AttendResult> answered;
  auto stream = client_->OpenStream([&](CallStatus s, AttendResult a) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    answered.set_value(std::move(a));
  });
  AttendRequest rest;
  rest.request_id = 77;
  for (int i = 0; i < kSessions; ++i) {
    Step step;
    step.session = sessions[i].handle;
    step.session_length = first[i];
    step.query = Tensor::Float32({1, 6 - first[i], 512}, rows(x[i], first[i], 6 - first[i]));
    rest.steps.push_back(step);
  }
  ASSERT_TRUE(stream->Send(rest));
  const AttendResult a = answered.get_future().get();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(a.request_id, 77u);
  ASSERT_EQ(a.steps.size(), 3u);
  for (int i = 0; i < kSessions; ++i) {
    EXPECT_EQ(a.steps[i].session_length, 6);
    EXPECT_TRUE(CloseTo(a.steps[i].output, rows(y[i], first[i], 6 - first[i]))) << "entry " << i;
    ASSERT_TRUE(client_->CloseSession(sessions[i].handle).ok());
  }
}

// Eight callers race steps onto one session. Each step is either applied whole or refused with
// ABORTED (a step in flight); the applied ones, ordered by the length they report, tile the session
// without gaps or overlap, and each answers the rows of one causal self-attention over the applied
// tokens in that order (float32, 1e-5 of the output's scale): never interleaved.
TEST_F(ServerTest, ConcurrentStepsOnOneSessionAreOrderedOrRefusedNeverInterleaved) {
  KvInfo session;
  ASSERT_TRUE(client_->OpenSession("demo", 1, &session).ok());
  struct Applied {
    int64_t end = 0;
    std::vector<float> tokens, output;
  };
  std::mutex mu;
  std::vector<Applied> applied;
  std::map<std::string, int> refused;
  std::vector<std::thread> callers;
  std::atomic<bool> go{false};
  for (int c = 0; c < 8; ++c) {
    callers.emplace_back([&, c] {
      std::mt19937 rng(100 + c);
      while (!go) std::this_thread::yield();
      for (int i = 0; i < 6; ++i) {
        AttendRequest step;
        step.session = session.handle;
        step.query = RandomTensor(rng, {1, 1 + (c + i) % 3, 512});
        AttendResult r;
        const CallStatus s = client_->Attend(step, &r);
        std::lock_guard<std::mutex> lock(mu);
        if (s.ok()) {
          applied.push_back({r.session_length, step.query.ToFloats(), r.output.ToFloats()});
        } else {
          ++refused[std::to_string(s.code) +
                    (s.message.find("already in flight") != std::string::npos ? " in flight"
                                                                              : " " + s.message)];
        }
      }
    });
  }
  go = true;
  for (auto& t : callers) t.join();
  for (const auto& [what, n] : refused) EXPECT_EQ(what, "10 in flight") << n << " times";
  ASSERT_FALSE(applied.empty());
  std::sort(applied.begin(), applied.end(),
            [](const Applied& a, const Applied& b) { return a.end < b.end; });
  std::vector<float> sequence;
  for (const Applied& a : applied) {
    ASSERT_EQ(static_cast<int64_t>(sequence.size() + a.tokens.size()) / 512, a.end)
        << "a gap or an overlap";
    sequence.insert(sequence.end(), a.tokens.begin(), a.tokens.end());
  }
  const int64_t n = static_cast<int64_t>(sequence.size()) / 512;
  AttendRequest whole;
  whole.query = Tensor::Float32({1, n, 512}, sequence);
  whole.is_causal = true;
  AttendResult all;
  ASSERT_TRUE(client_->Attend(whole, &all).ok());
  const std::vector<float> y = all.output.ToFloats();
  double scale = 0;
  for (float v : y) scale = std::max(scale, std::fabs(static_cast<double>(v)));
  size_t row = 0;
  for (const Applied& a : applied) {
    double err = 0;
    for (size_t i = 0; i < a.output.size(); ++i)
      err = std::max(err, std::fabs(static_cast<double>(a.output[i]) - y[row + i]));
    EXPECT_LE(err, 1e-5 * scale) << "the step ending at " << a.end;
    row += a.output.size();
  }
  std::printf("concurrent steps: %zu applied (%lld tokens), %d refused\n", applied.size(),
              static_cast<long long>(n), refused.empty() ? 0 : refused.begin()->second);
  ASSERT_TRUE(client_->CloseSession(session.handle).ok());
}

TEST_F(ServerTest, HalfPrecisionWireRoundTripsCloseToFloat32) {
  AttendRequest r32 = Request(1, 5, 0, 9);
  AttendRequest r16 = r32;
  r16.query = Tensor::Float16(r32.query.shape, r32.query.ToFloats());
  AttendResult a, b;
  ASSERT_TRUE(client_->Attend(r32, &a).ok());
  ASSERT_TRUE(client_->Attend(r16, &b).ok());
  ASSERT_EQ(b.output.dtype, DataType::kFloat16);
  const auto fa = a.output.ToFloats(), fb = b.output.ToFloats();
  for (size_t i = 0; i < fa.size(); ++i)
    ASSERT_NEAR(fa[i], fb[i], 2e-2 * std::max(1.f, std::fabs(fa[i])));

  // bfloat16: the upper half of each float32 (truncation), answered in bfloat16.
  AttendRequest rb = r32;
  rb.query.dtype = DataType::kBFloat16;
  rb.query.data.clear();
  for (size_t i = 0; i < r32.query.data.size(); i += 4)
    rb.query.data.append(r32.query.data, i + 2, 2);
  AttendResult c;
  ASSERT_TRUE(client_->Attend(rb, &c).ok());
  ASSERT_EQ(c.output.dtype, DataType::kBFloat16);
  ASSERT_EQ(c.output.data.size(), a.output.data.size() / 2);
  const auto fc = c.output.ToFloats();
  for (size_t i = 0; i < fa.size(); ++i)
    ASSERT_NEAR(fa[i], fc[i], 5e-2 * std::max(1.f, std::fabs(fa[i])));
}

// attnserve_kv_lookups_total counts one lookup per call that names a session: ForkSession and
// TruncateSession each looked theirs up twice (once themselves, once in the store's own call).
TEST_F(ServerTest, ForkAndTruncateCountOneLookupEach) {
  KvInfo session;
  ASSERT_TRUE(client_->OpenSession("demo", 1, &session).ok());
  AttendRequest step;
  step.session = session.handle;
  step.query = Request(1, 3, 0, 21).query;
  AttendResult r;
  ASSERT_TRUE(client_->Attend(step, &r).ok());
  const std::string hits = "attnserve_kv_lookups_total{kind=\"session\",result=\"hit\"}";
  const auto lookups = [&] { return Sample(HttpGet(server_->metrics_port(), "/metrics"), hits); };
  const double before = lookups();
  ASSERT_GT(before, 0);
  KvInfo fork;
  ASSERT_TRUE(client_->ForkSession(session.handle, &fork).ok());
  EXPECT_EQ(lookups(), before + 1) << "ForkSession";
  ASSERT_TRUE(client_->TruncateSession(session.handle, 1).ok());
  EXPECT_EQ(lookups(), before + 2) << "TruncateSession";
  ASSERT_TRUE(client_->CloseSession(fork.handle).ok());
  ASSERT_TRUE(client_->CloseSession(session.handle).ok());
}

// Tensor::BFloat16 rounds each float to the nearest bfloat16 (ties to even), keeps NaN a NaN and
// infinities infinite; ToFloats reads the values back exactly.
TEST(ClientTensorTest, BFloat16RoundsToNearestEven) {
  const float inf = std::numeric_limits<float>::infinity();
  const float one_ulp = 1.0f / 128;  // bfloat16's spacing at 1: 8 significant bits
  const std::vector<float> in = {1.0f,
                                 1.0f + one_ulp * 0.49f,  // rounds down
                                 1.0f + one_ulp * 0.51f,  // rounds up
                                 1.0f + one_ulp * 0.5f,   // tie: to even (1.0)
                                 1.0f + one_ulp * 1.5f,   // tie: to even (1 + 2 ulp)
                                 -3.0f,
                                 inf,
                                 -inf,
                                 std::numeric_limits<float>::quiet_NaN()};
  const Tensor t = Tensor::BFloat16({static_cast<int64_t>(in.size())}, in);
  ASSERT_EQ(t.dtype, DataType::kBFloat16);
  ASSERT_EQ(t.data.size(), in.size() * 2);
  const std::vector<float> out = t.ToFloats();
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 1.0f);
  EXPECT_EQ(out[2], 1.0f + one_ulp);
  EXPECT_EQ(out[3], 1.0f);
  EXPECT_EQ(out[4], 1.0f + 2 * one_ulp);
  EXPECT_EQ(out[5], -3.0f);
  EXPECT_EQ(out[6], inf);
  EXPECT_EQ(out[7], -inf);
  EXPECT_TRUE(std::isnan(out[8]));
}

TEST_F(ServerTest, BadRequestsGetInvalidArgumentNamingTheField) {
  AttendResult out;
  AttendRequest r = Request(2, 5, 3);
  r.key->shape = {2, 3 * 512};
  CallStatus s = client_->Attend(r, &out);
  EXPECT_EQ(s.code, 3);
  EXPECT_THAT(s.message,
              HasSubstr("key: shape [2, 1536] has 2 dims, expected [batch=2, key_len, kdim=512]"));

  r = Request(1, 5);
  r.query.data.pop_back();
  s = client_->Attend(r, &out);
  EXPECT_EQ(s.code, 3);
  EXPECT_THAT(s.message, HasSubstr("query: data has 10239 bytes, expected 10240"));

  r = Request(1, 5);
  r.attn_mask = Tensor::Bool({5, 4}, std::vector<bool>(20, false));
  s = client_->Attend(r, &out);
  EXPECT_THAT(s.message, HasSubstr("attn_mask: shape [5, 4] has key_len=4"));

  r = Request(1, 5);
  r.model = "missing";
  s = client_->Attend(r, &out);
  EXPECT_EQ(s.code, 5);
  EXPECT_THAT(s.message, HasSubstr("available: demo"));
}

TEST_F(ServerTest, StreamCompletesOutOfOrderAndSurvivesBadRequests) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->AttendStream(&ctx);
  std::mt19937 rng(5);
  auto send = [&](uint64_t id, int64_t b, int64_t len) {
    v1::AttendRequest req;
    req.set_model("demo");
    req.set_request_id(id);
    const Tensor q = RandomTensor(rng, {b, len, 512});
    req.mutable_query()->set_dtype(v1::DATA_TYPE_FLOAT32);
    req.mutable_query()->mutable_shape()->Assign(q.shape.begin(), q.shape.end());
    req.mutable_query()->set_data(q.data);
    ASSERT_TRUE(stream->Write(req));
  };
  send(0, 16, 384);  // Long: one worker stays busy with it.
  for (uint64_t id = 1; id <= 5; ++id) send(id, 1, 4);
  v1::AttendRequest bad;
  bad.set_model("demo");
  bad.set_request_id(99);
  ASSERT_TRUE(stream->Write(bad));  // No query.
  stream->WritesDone();
  std::vector<uint64_t> order;
  v1::AttendResponse resp;
  while (stream->Read(&resp)) {
    order.push_back(resp.request_id());
    if (resp.request_id() == 99) {
      EXPECT_EQ(resp.error().code(), 3);
      EXPECT_THAT(resp.error().message(), HasSubstr("query: missing"));
    } else {
      EXPECT_FALSE(resp.has_error()) << resp.error().message();
      EXPECT_EQ(resp.output().shape(2), 512);
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  ASSERT_EQ(order.size(), 7u);
  EXPECT_NE(order.front(), 0u) << "the long request should not come back first";
  EXPECT_EQ(std::count(order.begin(), order.end(), 0u), 1);
}

TEST_F(ServerTest, ClientStreamAnswersEveryRequestWithItsOwnStatus) {
  std::mutex mu;
  std::map<uint64_t, CallStatus> got;
  auto stream = client_->OpenStream([&](CallStatus s, AttendResult r) {
    std::lock_guard<std::mutex> lock(mu);
    if (s.ok())
      EXPECT_EQ(r.output.shape,
                (std::vector<int64_t>{1, 3 + static_cast<int64_t>(r.request_id), 512}));
    got[r.request_id] = s;
  });
  for (uint64_t id = 0; id < 4; ++id) {
    AttendRequest r = Request(1, 3 + static_cast<int64_t>(id));
    r.request_id = id;
    if (id == 2) r.model = "nope";
    ASSERT_TRUE(stream->Send(r));
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_FALSE(stream->Send(Request(1, 3)));
  ASSERT_EQ(got.size(), 4u);
  EXPECT_TRUE(got[0].ok() && got[1].ok() && got[3].ok());
  EXPECT_EQ(got[2].code, 5);
}

TEST_F(ServerTest, HealthReportsServerServiceAndModels) {
  bool serving = false;
  ASSERT_TRUE(client_->Health("", &serving).ok());
  EXPECT_TRUE(serving);
  ASSERT_TRUE(client_->Health("attnserve.v1.AttentionService", &serving).ok());
  EXPECT_TRUE(serving);
  ASSERT_TRUE(client_->Health("attnserve.v1.AttentionService/demo", &serving).ok());
  EXPECT_TRUE(serving);
  EXPECT_EQ(client_->Health("attnserve.v1.AttentionService/nope", &serving).code, 5);
}

// While the models warm up at start the server already listens: health (every name) says
// NOT_SERVING, a request sent anyway is still answered; once Start returns, everything says
// SERVING. (The client's default service config checks health itself and would send nothing to a
// NOT_SERVING server: gRPC's defaults here.)
TEST(ServerWarmupTest, HealthSaysNotServingUntilTheModelsAreWarm) {
  ServerOptions o;
  o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
  o.address = "127.0.0.1:0";
  o.metrics_address = "";
  o.batcher.workers = 2;
  struct Seen {
    bool server = true, service = true, model = true;
    CallStatus attend;
  } seen;
  o.warming_for_test = [&seen](int port) {
    ClientOptions c;
    c.target = "127.0.0.1:" + std::to_string(port);
    c.service_config = "";
    Client client(c);
    EXPECT_TRUE(client.Health("", &seen.server).ok());
    EXPECT_TRUE(client.Health("attnserve.v1.AttentionService", &seen.service).ok());
    EXPECT_TRUE(client.Health("attnserve.v1.AttentionService/demo", &seen.model).ok());
    std::mt19937 rng(3);
    AttendRequest r;
    r.query = RandomTensor(rng, {1, 5, 512});
    AttendResult res;
    seen.attend = client.Attend(r, &res);
  };
  auto s = Server::Start(o);
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_FALSE(seen.server);
  EXPECT_FALSE(seen.service);
  EXPECT_FALSE(seen.model);
  EXPECT_TRUE(seen.attend.ok()) << seen.attend.ToString();
  EXPECT_THAT((*s)->Describe(), HasSubstr("warmed in"));
  Client client(TargetOf(**s));
  bool serving = false;
  ASSERT_TRUE(client.Health("", &serving).ok());
  EXPECT_TRUE(serving);
  ASSERT_TRUE(client.Health("attnserve.v1.AttentionService/demo", &serving).ok());
  EXPECT_TRUE(serving);
}

// The listening socket of this process bound to `port` (-1 when none).
int ListeningSocketOn(int port) {
  for (int fd = 0; fd < 4096; ++fd) {
    int listening = 0;
    socklen_t len = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_in6 local{};  // IPv4's port lies where IPv6's does.
    len = sizeof local;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        (local.sin6_family == AF_INET || local.sin6_family == AF_INET6) &&
        ntohs(local.sin6_port) == port) {
      return fd;
    }
  }
  return -1;
}

// gRPC 1.51's listener ends for good on an accept error it does not expect (CVE-2023-4785), and
// health went on saying SERVING (a hostile review, 2026-12-05: 20,100 idle connections). Here the
// listening socket is shut behind gRPC's back, so accept fails and gRPC's listener ends: within a
// few seconds every name says NOT_SERVING, on the --health-address listener, which still answers.
TEST(ServerListenerTest, HealthSaysNotServingOnceTheListenerAcceptsNothing) {
  ServerOptions o;
  o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
  o.address = "127.0.0.1:0";
  o.metrics_address = "";
  o.health_address = "127.0.0.1:0";
  o.warmup = false;
  o.batcher.workers = 1;
  auto s = Server::Start(o);
  ASSERT_TRUE(s.ok()) << s.status().message();
  ClientOptions c;
  c.target = "127.0.0.1:" + std::to_string((*s)->health_port());
  c.service_config = "";
  Client health(c);
  bool serving = false;
  ASSERT_TRUE(health.Health("", &serving).ok());
  ASSERT_TRUE(serving);
  const int listener = ListeningSocketOn((*s)->port());
  ASSERT_GE(listener, 0);
  ASSERT_EQ(::shutdown(listener, SHUT_RDWR), 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (serving && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(health.Health("", &serving).ok());
  }
  EXPECT_FALSE(serving) << "health still says SERVING with the listener gone";
  bool service = true;
  ASSERT_TRUE(health.Health("attnserve.v1.AttentionService", &service).ok());
  EXPECT_FALSE(service);
}

TEST_F(ServerTest, MetricsMoveAfterRequests) {
  const std::string ok_count =
      "attnserve_request_duration_seconds_count{code=\"OK\",method=\"Attend\",model=\"demo\"}";
  const std::string bad_total =
      "attnserve_requests_total{code=\"INVALID_ARGUMENT\",method=\"Attend\",model=\"demo\"}";
  const std::string before = HttpGet(server_->metrics_port(), "/metrics");
  ASSERT_THAT(before, HasSubstr("200 OK"));
  const double ok0 = std::max(0.0, Sample(before, ok_count));
  const double bad0 = std::max(0.0, Sample(before, bad_total));
  const std::string decoded = "attnserve_stage_seconds_count{stage=\"decode\"}",
                    encoded = "attnserve_stage_seconds_count{stage=\"encode\"}";
  const double decoded0 = std::max(0.0, Sample(before, decoded)),
               encoded0 = std::max(0.0, Sample(before, encoded));
  AttendResult out;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client_->Attend(Request(1, 8), &out).ok());
  AttendRequest bad = Request(1, 8);
  bad.query.shape = {1, 8, 511};
  EXPECT_EQ(client_->Attend(bad, &out).code, 3);
  const std::string after = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_EQ(Sample(after, ok_count), ok0 + 3);
  // Where the time goes: each answered request's decode and encode; a batch's device stages only
  // on a GPU.
  EXPECT_GE(Sample(after, decoded), decoded0 + 3);
  EXPECT_GE(Sample(after, encoded), encoded0 + 3);
  EXPECT_GT(Sample(after, "attnserve_stage_seconds_sum{stage=\"decode\"}"), 0);
  EXPECT_EQ(after.find("stage=\"copy_in\""), std::string::npos);
  EXPECT_EQ(Sample(after, bad_total), bad0 + 1);
  EXPECT_GT(Sample(after, "attnserve_queue_wait_seconds_count{model=\"demo\"}"), 0);
  EXPECT_GT(Sample(after, "attnserve_compute_seconds_sum{model=\"demo\"}"), 0);
  EXPECT_GT(Sample(after, "attnserve_batch_size_requests_count{model=\"demo\"}"), 0);
  EXPECT_GT(Sample(after, "attnserve_batch_size_tokens_sum{model=\"demo\"}"), 0);
  // Rows are packed, never padded: there is no padding gauge that could only say 0.
  EXPECT_EQ(after.find("attnserve_batch_padding_fraction"), std::string::npos);
  EXPECT_GT(Sample(after, "attnserve_attention_backend_total{backend=\"math\",model=\"demo\"}"), 0);
  EXPECT_GT(Sample(after, "attnserve_flops_total{model=\"demo\"}"), 1e6);
  EXPECT_GT(Sample(after, "attnserve_achieved_flops_per_second{model=\"demo\"}"), 1e6);
  EXPECT_EQ(Sample(after, "attnserve_requests_in_flight{method=\"Attend\"}"), 0);
  EXPECT_THAT(after, HasSubstr("attnserve_model_info{"));
  // The kernels a model runs on, and the CPU's class for bfloat16 products.
  EXPECT_THAT(after, ::testing::ContainsRegex("attnserve_model_info\\{[^}]*kernels=\"[^\"]+\""));
  EXPECT_THAT(after, ::testing::ContainsRegex("attnserve_cpu_info\\{[^}]*cpu_class=\"(AMX|AVX512-"
                                              "BF16|AVX-512 without BF16|AVX2 only)\""));
  // Histogram buckets are cumulative and end at the count.
  std::regex bucket(
      R"re(attnserve_request_duration_seconds_bucket\{code="OK",method="Attend",model="demo",le="([^"]+)"\} (\d+))re");
  double last = -1;
  for (auto it = std::sregex_iterator(after.begin(), after.end(), bucket);
       it != std::sregex_iterator(); ++it) {
    const double v = std::stod((*it)[2]);
    EXPECT_GE(v, last);
    last = v;
  }
  EXPECT_EQ(last, Sample(after, ok_count));
}

// The client's built-in service configs are the JSON files deploy/grpc/ ships for other clients.
TEST(ServiceConfigTest, ConstantsAreTheDeployFiles) {
  const auto file = [](const char* name) {
    std::ifstream in(std::string(test_paths::kSourceDir) + "/deploy/grpc/" + name);
    EXPECT_TRUE(in.good()) << name;
    return nlohmann::json::parse(in);
  };
  EXPECT_EQ(nlohmann::json::parse(kDefaultServiceConfig), file("service-config.json"));
  EXPECT_EQ(nlohmann::json::parse(kProxyServiceConfig), file("service-config-proxy.json"));
  EXPECT_FALSE(nlohmann::json::parse(kProxyServiceConfig).contains("healthCheckConfig"));
}

TEST(GrpcStatusTest, OneMappingForEveryCode) {
  const std::pair<StatusCode, grpc::StatusCode> table[] = {
      {StatusCode::kOk, grpc::StatusCode::OK},
      {StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
      {StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {StatusCode::kInternal, grpc::StatusCode::INTERNAL}};
  for (const auto& [ours, theirs] : table) {
    const grpc::Status g = ToGrpcStatus(Status(ours, ours == StatusCode::kOk ? "" : "why"));
    EXPECT_EQ(g.error_code(), theirs) << StatusCodeName(ours);
  }
  EXPECT_EQ(Status(StatusCode::kInternal, std::string(5000, 'x')).message().size(),
            kMaxStatusMessage);
}

// Overload and deadlines end to end: one worker, a queue of 2, requests that take a while.
// Sessions and memories through one client balanced over two replicas: each call on one reaches
// the replica that made it (ClientOptions::route_to_replica); without routing, calls that land on
// the other replica are NOT_FOUND naming both.
TEST(ReplicaRoutingTest, SessionsFollowTheirReplicaThroughARoundRobinTarget) {
  std::vector<std::unique_ptr<Server>> replicas;
  for (int i = 0; i < 2; ++i) {
    ServerOptions o;
    o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
    o.address = "127.0.0.1:0";
    o.metrics_address = "";
    o.batcher.workers = 1;
    auto s = Server::Start(o);
    ASSERT_TRUE(s.ok()) << s.status().message();
    replicas.push_back(std::move(s).value());
  }
  const std::string target =
      "ipv4:" + TargetOf(*replicas[0]).target + "," + TargetOf(*replicas[1]).target;
  std::mt19937 rng(21);
  for (bool routed : {true, false}) {
    ClientOptions options;
    options.target = target;
    options.route_to_replica = routed;
    Client client(options);
    std::set<std::string> seen;
    // round_robin spreads calls over the replicas it is connected to (and has seen SERVING): wait
    // until both are, up to 20 s on a loaded machine.
    for (int tries = 0; tries < 2000 && seen.size() < 2; ++tries) {
      KvInfo s;
      ASSERT_TRUE(client.OpenSession("demo", 1, &s).ok());
      seen.insert(s.replica);  // Left open: a close through the target would take every other turn.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(seen.size(), 2u);
    seen.clear();
    int answered = 0, misrouted = 0;
    for (int n = 0; n < 6; ++n) {
      // One more balanced call on odd rounds, so sessions land on both replicas.
      std::vector<ModelInfo> models;
      if (n % 2 == 1) ASSERT_TRUE(client.ListModels(&models).ok());
      KvInfo session, memory;
      ASSERT_TRUE(client.OpenSession("demo", 1, &session).ok());
      seen.insert(session.replica);
      MemoryRequest m;
      m.key = RandomTensor(rng, {1, 5, 512});
      m.value = RandomTensor(rng, {1, 5, 512});
      ASSERT_TRUE(client.CreateMemory(m, &memory).ok());
      EXPECT_EQ(memory.handle.substr(0, 8) == session.handle.substr(0, 8),
                memory.replica == session.replica);
      for (int call = 0; call < 8; ++call) {  // 4 session steps, then 4 memory queries
        AttendRequest r;
        r.query = RandomTensor(rng, {1, 1, 512});
        (call < 4 ? r.session : r.memory) = call < 4 ? session.handle : memory.handle;
        AttendResult res;
        const CallStatus c = client.Attend(r, &res);
        if (c.ok()) {
          ++answered;
        } else {
          EXPECT_EQ(c.code, 5) << c.ToString();
          EXPECT_THAT(c.message, HasSubstr("made by replica " +
                                           (call < 4 ? session : memory).handle.substr(0, 8)));
          ++misrouted;
        }
      }
      client.CloseSession(session.handle);
      client.DeleteMemory(memory.handle);
    }
    EXPECT_EQ(seen, (std::set<std::string>{TargetOf(*replicas[0]).target,
                                           TargetOf(*replicas[1]).target}));
    if (routed) {
      EXPECT_EQ(misrouted, 0);
      EXPECT_EQ(answered, 6 * 4 * 2);
    } else {
      EXPECT_GT(misrouted, 0);  // round_robin alternates: about half land elsewhere
    }
  }
}

TEST(ServerLoadTest, OverloadIsRefusedQuicklyAndExpiredRequestsAreDropped) {
  ServerOptions o;
  o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
  o.address = "127.0.0.1:0";
  o.metrics_address = "127.0.0.1:0";
  o.batcher.workers = 1;
  o.batcher.max_queue_size = 2;
  o.batcher.enabled = false;  // One request per batch: the queue fills.
  auto server = Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status().message();
  Client client(TargetOf(**server));
  std::mt19937 rng(8);
  AttendRequest big;
  big.query = RandomTensor(rng, {16, 256, 512});
  std::mutex mu;
  std::map<int, int> codes;
  std::atomic<int> pending{0};
  std::vector<double> refuse_ms;
  for (int i = 0; i < 8; ++i) {
    ++pending;
    const auto sent = std::chrono::steady_clock::now();
    client.AttendAsync(big, [&, sent](CallStatus s, AttendResult) {
      std::lock_guard<std::mutex> lock(mu);
      ++codes[s.code];
      if (s.code == 8) {
        refuse_ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - sent)
                .count());
      }
      --pending;
    });
  }
  while (pending > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_GE(codes[0], 1);
  EXPECT_GE(codes[8], 1) << "RESOURCE_EXHAUSTED expected under overload";
  EXPECT_EQ(codes[0] + codes[8], 8);
  for (double ms : refuse_ms) EXPECT_LT(ms, 1000) << "refusals must be quick";

  // A request whose deadline passes while it waits behind a long one is dropped before compute.
  // The long one (0.3-0.6 s of compute on one core) is in compute before the short one is sent:
  // the server holds it in flight (8 MiB did not always arrive within a fixed 20 ms on a loaded
  // machine, and the short one was then answered first).
  AttendRequest longer;
  longer.query = RandomTensor(rng, {2, 2048, 512});
  std::promise<void> first_done;
  client.AttendAsync(longer, [&](CallStatus, AttendResult) { first_done.set_value(); });
  const std::string in_flight = "attnserve_requests_in_flight{method=\"Attend\"}";
  for (int i = 0;
       i < 2000 && Counter(HttpGet((*server)->metrics_port(), "/metrics"), in_flight) < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  AttendRequest small;
  small.query = RandomTensor(rng, {1, 4, 512});
  AttendResult out;
  CallOptions call;
  call.deadline = std::chrono::milliseconds(100);
  // In flight is not yet queued: the long one is counted before the server has validated its 8
  // MiB, and under ASan a short one sent then could be queued first and answered (CI, 2026-12-02).
  // A short one answered while the long one still runs was ahead of it; the next one is behind.
  std::future<void> long_done = first_done.get_future();
  int code = client.Attend(small, &out, call).code;
  for (int i = 0; code == 0 && i < 20 &&
                  long_done.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
       ++i) {
    code = client.Attend(small, &out, call).code;
  }
  EXPECT_EQ(code, 4);
  long_done.wait();
  // The dropped request is counted when the worker takes it from the queue, which may be after the
  // long one's answer has arrived: wait for the count (not a fixed time).
  const std::string dropped = "attnserve_rejections_total{model=\"demo\",reason=\"deadline\"}";
  WaitUntil([&] { return Sample(HttpGet((*server)->metrics_port(), "/metrics"), dropped) >= 1; },
            std::chrono::seconds(10), std::chrono::milliseconds(5));
  const std::string m = HttpGet((*server)->metrics_port(), "/metrics");
  EXPECT_EQ(
      Sample(
          m,
          "attnserve_requests_total{code=\"DEADLINE_EXCEEDED\",method=\"Attend\",model=\"demo\"}"),
      1)
      << m.substr(0, 4000);
  EXPECT_GE(
      Sample(
          m,
          "attnserve_requests_total{code=\"RESOURCE_EXHAUSTED\",method=\"Attend\",model=\"demo\"}"),
      1);
  EXPECT_GE(Sample(m, "attnserve_rejections_total{model=\"demo\",reason=\"queue_full\"}"), 1);
  EXPECT_EQ(Sample(m, dropped), 1);
}

TEST(ServerShutdownTest, InFlightRequestsFinishOnShutdown) {
  ServerOptions o;
  o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
  o.address = "127.0.0.1:0";
  o.metrics_address = "127.0.0.1:0";
  o.batcher.workers = 1;
  auto server = Server::Start(o);
  ASSERT_TRUE(server.ok());
  Client client(TargetOf(**server));
  std::mt19937 rng(4);
  AttendRequest r;
  r.query = RandomTensor(rng, {8, 128, 512});
  // Connect first (channel and its health watch): the four calls below then reach the server at
  // once.
  AttendResult warm;
  ASSERT_TRUE(client.Attend(r, &warm).ok());
  std::atomic<int> ok{0}, done{0};
  for (int i = 0; i < 4; ++i) {
    client.AttendAsync(r, [&](CallStatus s, AttendResult res) {
      if (s.ok() && res.output.shape.size() == 3) ++ok;
      ++done;
    });
  }
  // All four accepted (in flight or answered) before the stop: a fixed wait is not enough for 2 MiB
  // on a loaded machine.
  const auto taken = [&] {
    const std::string m = HttpGet((*server)->metrics_port(), "/metrics");
    return Counter(m, "attnserve_requests_in_flight{method=\"Attend\"}") +
           Counter(m, "attnserve_requests_total{code=\"OK\",method=\"Attend\",model=\"demo\"}");
  };
  WaitUntil([&] { return taken() >= 5; }, std::chrono::seconds(10), std::chrono::milliseconds(5));
  EXPECT_GE(taken(), 5) << "the warm-up call and the four";
  (*server)->Shutdown();
  while (done < 4) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(ok, 4);
  EXPECT_EQ((*server)->shutdown_outcome()->calls_cut(), 0);
  EXPECT_EQ((*server)->shutdown_outcome()->calls->open(), 0);
  AttendResult out;
  CallOptions call;
  call.deadline = std::chrono::milliseconds(500);
  EXPECT_NE(client.Attend(r, &out, call).code, 0) << "a stopped server takes no new calls";
}

// Sanitizers slow everything several times; a timing bound is scaled for them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kSlowdown = 5;
#else
constexpr int kSlowdown = 1;
#endif

// The attnserve binary as a child process on a free port, its output read through a pipe.
class ChildServer {
 public:
  explicit ChildServer(std::vector<std::string> flags) {
    std::vector<std::string> args = {
        test_paths::kServerBinary, "--address",  "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
        "--http-address",          "127.0.0.1:0"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int fds[2];
    if (pipe(fds) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[4096];
    if (pid_ > 0 && fgets(line, sizeof line, out_) != nullptr) {
      banner_ = line;
      std::smatch m;
      if (std::regex_search(banner_, m, std::regex(" on 127\\.0\\.0\\.1:(\\d+)")))
        port_ = std::stoi(m[1]);
    }
    // Read what it prints as it comes: a full pipe would stop it.
    reader_ = std::thread([this] {
      char buf[4096];
      size_t n;
      while ((n = fread(buf, 1, sizeof buf, out_)) > 0) {
        std::lock_guard<std::mutex> lock(mu_);
        output_.append(buf, n);
      }
    });
  }
  ~ChildServer() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (reader_.joinable()) reader_.join();
    if (out_ != nullptr) fclose(out_);
  }
  int port() const { return port_; }
  const std::string& banner() const { return banner_; }
  /// SIGTERM, then the seconds until the process is gone (at most 30: then SIGKILL); `code` gets
  /// its exit status (-1: it did not exit by itself) and `output` what it printed after the banner.
  double Stop(int* code, std::string* output) {
    const auto start = std::chrono::steady_clock::now();
    kill(pid_, SIGTERM);
    int status = 0;
    bool exited = false;
    while (!(exited = waitpid(pid_, &status, WNOHANG) == pid_) &&
           std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!exited) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
    reaped_ = true;
    *code = exited && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    reader_.join();
    std::lock_guard<std::mutex> lock(mu_);
    *output = output_;
    return took;
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  std::string banner_;
  int port_ = 0;
  bool reaped_ = false;
  std::thread reader_;
  std::mutex mu_;
  std::string output_;
};

// A rolling restart with a C++ client connected and idle (its channel keeps its connection and a
// health watch open): SIGTERM stops the binary in under a second with exit 0, at --shutdown-grace
// 2. It took ~2 s and exited 1 (the watchdog): gRPC waited for the client to close its connection.
TEST(ServerShutdownTest, BinaryStopsAtOnceWithAnIdleClientConnected) {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer holds a signal that lands on a thread it does not see wake (OpenBLAS's pool,
  // started before main and not blocking SIGTERM) until that thread calls into it: the TSan
  // binary never stops on SIGTERM. The in-process shutdown tests run under TSan; this one runs in
  // the plain and ASan builds.
  GTEST_SKIP() << "the attnserve binary under ThreadSanitizer does not act on SIGTERM";
#endif
  ChildServer child({"--shutdown-grace", "2"});
  ASSERT_GT(child.port(), 0) << child.banner();
  ClientOptions c;
  c.target = "127.0.0.1:" + std::to_string(child.port());
  Client client(c);
  std::mt19937 rng(22);
  AttendRequest r;
  r.query = RandomTensor(rng, {1, 4, 512});
  AttendResult out;
  ASSERT_TRUE(client.Attend(r, &out).ok());
  std::this_thread::sleep_for(
      std::chrono::milliseconds(500));  // Idle past the drain's quiet period.
  int code = 0;
  std::string output;
  const double took = child.Stop(&code, &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_LT(took, 1.0 * kSlowdown) << output;
  EXPECT_THAT(output, HasSubstr("attnserve: stopped"));
}

}  // namespace
}  // namespace attnserve
