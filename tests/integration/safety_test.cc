// AttendStream and the unary path under cancellation, shutdown, flood, oversize answers, memory
// pressure and deadlines. Real server in-process, real wire, real /metrics.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/grpc/stream_reactor.h"
#include "tests/integration/test_support.h"
#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

using testing::Counter;
using ::testing::HasSubstr;
using testing::HttpGet;
using testing::RandomTensor;

std::unique_ptr<Server> StartServer(const std::function<void(ServerOptions&)>& tweak = {}) {
  ServerOptions o;
  o.http.address = "";  // Each test server on its own ports: no HTTP unless a test asks.
  o.address = "127.0.0.1:0";
  o.metrics_address = "127.0.0.1:0";
  if (tweak) tweak(o);
  auto s = Server::Start(o);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return s.ok() ? std::move(s).value() : nullptr;
}

std::unique_ptr<v1::AttentionService::Stub> StubFor(const Server& server) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  return v1::AttentionService::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials(), args));
}

v1::AttendRequest WireRequest(std::mt19937& rng, uint64_t id, std::vector<int64_t> shape) {
  const Tensor q = RandomTensor(rng, std::move(shape));
  v1::AttendRequest r;
  r.set_model("demo");
  r.set_request_id(id);
  r.mutable_query()->set_dtype(v1::DATA_TYPE_FLOAT32);
  r.mutable_query()->mutable_shape()->Assign(q.shape.begin(), q.shape.end());
  r.mutable_query()->set_data(q.data);
  return r;
}

std::string Metrics(const Server& s) { return HttpGet(s.metrics_port(), "/metrics"); }

// Runs Shutdown on another thread; its duration, or -1 when it did not return within `limit`.
double TimedShutdown(Server& server, std::chrono::seconds limit) {
  const auto start = std::chrono::steady_clock::now();
  auto done = std::async(std::launch::async, [&] { server.Shutdown(); });
  if (done.wait_for(limit) != std::future_status::ready) {
    done.wait();  // Leaking a hung server would hide the failure behind a crash.
    return -1;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// AttendStream requests the server has taken: answered or refused (under any model label, "" for
// those never matched to a model) plus those still in flight.
double StreamRequestsTaken(const std::string& m) {
  double n =
      std::max(0.0, testing::Sample(m, "attnserve_requests_in_flight{method=\"AttendStream\"}"));
  for (const char* code : {"OK", "CANCELLED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}) {
    for (const char* model : {"demo", ""}) {
      n += Counter(m, std::string("attnserve_requests_total{code=\"") + code +
                          "\",method=\"AttendStream\",model=\"" + model + "\"}");
    }
  }
  return n;
}

// 2a: a client that cancels with several requests pending must not leave the stream unfinished.
// The cancel goes out once the server holds all six of a round's requests (one computing, the
// rest queued: each is a batch of its own), so the count below is exact, not a race with the wire.
TEST(StreamSafetyTest, CancelWithPendingRequestsFinishesTheStreamAndShutdownCompletes) {
  auto server = StartServer([](ServerOptions& o) { o.batcher.workers = 1; });
  ASSERT_TRUE(server);
  auto stub = StubFor(*server);
  std::mt19937 rng(11);
  for (int round = 0; round < 3; ++round) {
    grpc::ClientContext ctx;
    auto stream = stub->AttendStream(&ctx);
    for (uint64_t id = 0; id < 6; ++id)
      ASSERT_TRUE(stream->Write(WireRequest(rng, id, {4, 256, 512})));
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (StreamRequestsTaken(Metrics(*server)) < 6 * (round + 1) &&
           std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ctx.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Every request is accounted for and nothing stays in flight.
  std::string m;
  for (int i = 0; i < 100; ++i) {
    m = Metrics(*server);
    if (testing::Sample(m, "attnserve_requests_in_flight{method=\"AttendStream\"}") == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(testing::Sample(m, "attnserve_requests_in_flight{method=\"AttendStream\"}"), 0);
  EXPECT_EQ(StreamRequestsTaken(m), 18) << m.substr(0, 3000);
  const double cancelled =
      Counter(
          m,
          "attnserve_requests_total{code=\"CANCELLED\",method=\"AttendStream\",model=\"demo\"}") +
      Counter(m, "attnserve_requests_total{code=\"CANCELLED\",method=\"AttendStream\",model=\"\"}");
  EXPECT_GT(cancelled, 0) << m.substr(0, 3000);
  const double took = TimedShutdown(*server, std::chrono::seconds(20));
  EXPECT_GE(took, 0) << "Shutdown hung";
  EXPECT_LT(took, 10);
}

// 2b: SIGTERM with streams open: accepted requests are answered, new ones get UNAVAILABLE, every
// stream is finished, and shutdown ends within the grace period. One stream is idle (a read is
// outstanding with nothing to read), one keeps sending.
TEST(StreamSafetyTest, ShutdownAnswersAcceptedRefusesNewAndFinishesEveryStream) {
  auto server = StartServer([](ServerOptions& o) { o.shutdown_grace_seconds = 8; });
  ASSERT_TRUE(server);
  auto stub = StubFor(*server);
  grpc::ClientContext idle_ctx, busy_ctx;
  auto idle = stub->AttendStream(&idle_ctx);
  auto busy = stub->AttendStream(&busy_ctx);
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread writer([&] {
    std::mt19937 rng(12);
    for (uint64_t id = 0; !stop && id < 20000; ++id) {
      if (!busy->Write(WireRequest(rng, id, {2, 16, 512}))) break;
      ++sent;
    }
    busy->WritesDone();
  });
  std::map<int, int> codes;  // Per-request outcome: 0 answered, else the error code.
  std::atomic<int> answered{0};
  std::thread reader([&] {
    v1::AttendResponse r;
    while (busy->Read(&r)) {
      ++codes[r.has_error() ? r.error().code() : 0];
      answered += r.has_error() ? 0 : 1;
    }
  });
  // The stream is being served before the shutdown: some answers read (not a fixed time, which a
  // loaded machine may spend before the first answer).
  testing::WaitUntil([&] { return answered > 10; }, std::chrono::seconds(30));
  const double took = TimedShutdown(*server, std::chrono::seconds(30));
  stop = true;
  writer.join();
  reader.join();
  const grpc::Status busy_end = busy->Finish();
  v1::AttendResponse r;
  EXPECT_FALSE(idle->Read(&r));
  const grpc::Status idle_end = idle->Finish();
  EXPECT_GE(took, 0) << "Shutdown hung";
  EXPECT_LT(took, 8) << "past the grace period";
  EXPECT_EQ(idle_end.error_code(), grpc::StatusCode::UNAVAILABLE) << idle_end.error_message();
  EXPECT_TRUE(busy_end.error_code() == grpc::StatusCode::UNAVAILABLE || busy_end.ok())
      << busy_end.error_code() << " " << busy_end.error_message();
  EXPECT_GT(codes[0], 10) << "requests before the shutdown were answered";
  for (const auto& [code, n] : codes) {
    EXPECT_TRUE(code == 0 || code == grpc::StatusCode::UNAVAILABLE)
        << n << " answers with code " << code;
  }
  EXPECT_LT(codes[0] + codes[14], 20000) << "the stream kept being served";
}

// 2c: a stream whose client never reads its answers is held back by flow control: the server
// keeps at most --max-stream-inflight of its requests, and every request is answered once the
// client reads.
// A compute thread that queued a stream's answer behind a write in flight holds nothing of the
// call once it lets go of the reactor's lock: gRPC's threads may write that answer, finish the
// stream and delete the reactor before the thread goes on. The seam sleeps in exactly that window.
// Before the fix the thread then read the deleted reactor (the pipeline and method it records
// with): AddressSanitizer reported it here (tools/sanitize.sh), and once in 10 runs of
// ShutdownAnswersAccepted... without the seam.
TEST(StreamSafetyTest, AComputeThreadTouchesNoReactorThatTheStreamsEndDeleted) {
  static std::atomic<int> windows{0};
  StreamReactor::computed_unlocked_for_test = +[](bool holds_call_open) {
    if (holds_call_open) return;
    ++windows;
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
  };
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto stub = StubFor(*server);
  std::mt19937 rng(11);
  // At least 8 rounds, and more until one answer was queued behind a write (the window this test
  // is about): how often it opens depends on the transport's timing (faster writes, fewer).
  for (int round = 0; round < 8 || (windows.load() == 0 && round < 400); ++round) {
    grpc::ClientContext ctx;
    auto stream = stub->AttendStream(&ctx);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(stream->Write(WireRequest(rng, i, {1, 8, 512})));
    stream->WritesDone();
    v1::AttendResponse r;
    int answers = 0;
    while (stream->Read(&r)) answers += !r.has_error();
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_EQ(answers, 4);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the last sleepers go on
  StreamReactor::computed_unlocked_for_test = nullptr;
  EXPECT_GT(windows.load(), 0) << "no answer was queued behind a write: the window never opened";
  server->Shutdown();
}

TEST(StreamSafetyTest, UnreadStreamIsHeldBackByFlowControl) {
  auto server = StartServer([](ServerOptions& o) { o.flow.max_stream_requests = 4; });
  ASSERT_TRUE(server);
  auto stub = StubFor(*server);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub->AttendStream(&ctx);
  // 128 KiB each: 50 MiB if the server took them all; the writer settles at 66-77 (8-10 MiB in the
  // transport's windows). Under the sanitizers, computing the answers is most of the test's time.
  constexpr int kRequests = testing::Repetitions(400, 2);
  std::atomic<int> written{0};
  std::thread writer([&] {
    std::mt19937 rng(13);
    const v1::AttendRequest proto = WireRequest(rng, 0, {1, 64, 512});
    for (int id = 0; id < kRequests; ++id) {
      v1::AttendRequest r = proto;
      r.set_request_id(static_cast<uint64_t>(id));
      if (!stream->Write(r)) break;
      ++written;
    }
    stream->WritesDone();
  });
  // Held back once the server holds its 4 requests and the transport's windows are full: the
  // writer's count settles (unchanged over 20 polls of 50 ms); if the server kept reading, it
  // settles at kRequests.
  int last = -1;
  for (int polls = 0, still = 0; polls < 1200 && still < 20; ++polls) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const int now = written.load();
    still = now == last ? still + 1 : 0;
    last = now;
  }
  const std::string m = Metrics(*server);
  EXPECT_LE(testing::Sample(m, "attnserve_requests_in_flight{method=\"AttendStream\"}"), 4);
  EXPECT_LT(written.load(), kRequests)
      << "the server kept reading without answers being taken (settled at " << last << ")";
  int answered = 0;
  v1::AttendResponse r;
  while (stream->Read(&r)) answered += r.has_error() ? 0 : 1;
  writer.join();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(answered, kRequests);
}

// 2c/2f: what all requests together hold is bounded; past it requests are refused, quickly.
TEST(StreamSafetyTest, InFlightBytesAreBoundedAcrossCalls) {
  auto server = StartServer([](ServerOptions& o) {
    o.flow.max_inflight_bytes = 8 << 20;
    o.batcher.workers = 1;
  });
  ASSERT_TRUE(server);
  Client client(testing::TargetOf(*server));
  std::mt19937 rng(14);
  AttendRequest big;
  big.query = RandomTensor(rng, {8, 256, 512});  // 4 MiB in, 4 MiB out.
  std::mutex mu;
  std::map<int, int> codes;
  std::string message;
  std::atomic<int> pending{0};
  for (int i = 0; i < 6; ++i) {
    ++pending;
    client.AttendAsync(big, [&](CallStatus s, AttendResult) {
      std::lock_guard<std::mutex> lock(mu);
      ++codes[s.code];
      if (s.code == 8) message = s.message;
      --pending;
    });
  }
  while (pending > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_GE(codes[0], 1);
  EXPECT_GE(codes[8], 1);
  EXPECT_EQ(codes[0] + codes[8], 6);
  EXPECT_THAT(message, HasSubstr("--max-inflight-bytes"));
  EXPECT_GE(
      Counter(Metrics(*server), "attnserve_rejections_total{model=\"demo\",reason=\"memory\"}"), 1);
}

// 2e: an answer larger than the message limit is refused before compute, unary and in a stream
// (where the stream goes on).
TEST(StreamSafetyTest, OversizeAnswerIsRefusedBeforeCompute) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  Client client(testing::TargetOf(*server));
  std::mt19937 rng(15);
  AttendRequest r;
  r.query = RandomTensor(rng, {1, 2048, 512});
  r.attn_weights = AttnWeights::kPerHead;  // 8 x 2048 x 2048 floats: 128 MiB.
  AttendResult out;
  const auto start = std::chrono::steady_clock::now();
  const CallStatus s = client.Attend(r, &out);
  EXPECT_EQ(s.code, 3) << s.ToString();
  EXPECT_THAT(s.message, HasSubstr("--max-message-bytes"));
  EXPECT_THAT(s.message, HasSubstr("PER_HEAD attn_weights [1, 8, 2048, 2048]"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);

  auto stub = StubFor(*server);
  grpc::ClientContext ctx;
  auto stream = stub->AttendStream(&ctx);
  v1::AttendRequest big = WireRequest(rng, 1, {1, 2048, 512});
  big.set_attn_weights(v1::ATTN_WEIGHTS_PER_HEAD);
  ASSERT_TRUE(stream->Write(big));
  ASSERT_TRUE(stream->Write(WireRequest(rng, 2, {1, 8, 512})));
  stream->WritesDone();
  std::map<uint64_t, int> got;
  v1::AttendResponse resp;
  while (stream->Read(&resp)) got[resp.request_id()] = resp.has_error() ? resp.error().code() : 0;
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(got[1], 3);
  EXPECT_EQ(got[2], 0);
  EXPECT_EQ(got.size(), 2u);
  const std::string m = Metrics(*server);
  EXPECT_EQ(Counter(m, "attnserve_requests_total{code=\"OK\",method=\"Attend\",model=\"demo\"}"),
            0);
}

// 3: a request computed after its deadline passed is recorded as the client saw it.
TEST(DeadlineTest, AnswerComputedAfterTheDeadlineIsRecordedAsDeadlineExceeded) {
  auto server = StartServer([](ServerOptions& o) { o.batcher.workers = 1; });
  ASSERT_TRUE(server);
  Client client(testing::TargetOf(*server));
  std::mt19937 rng(16);
  AttendRequest r;
  // 16 MiB whose compute is several times the deadline on either flavour ([4, 2048, 512]: 0.8 s
  // unloaded on LibTorch 1.13, 1.2 s on 2.11; [1, 4096, 512] took 0.4-0.5 s, and [2, 1536, 512]
  // against 150 ms was answered in time once on 2.11).
  r.query = RandomTensor(rng, {4, 2048, 512});
  const auto series = [](const char* code) {
    return std::string("attnserve_requests_total{code=\"") + code +
           "\",method=\"Attend\",model=\"demo\"}";
  };
  const std::string ok = series("OK"), late = series("DEADLINE_EXCEEDED");
  const std::string in_flight = "attnserve_requests_in_flight{method=\"Attend\"}";
  std::string m;
  // On a loaded 2-core machine the request may not all arrive within the deadline (the client
  // fails it before it is sent, or the server sees a call without its message): then nothing is
  // recorded for model "demo" and the server holds nothing in flight for a whole second, and the
  // test tries again with twice the deadline, at most a quarter of the compute.
  for (int ms = 100; ms <= 200; ms *= 2) {
    AttendResult out;
    CallOptions call;
    call.deadline = std::chrono::milliseconds(ms);
    EXPECT_EQ(client.Attend(r, &out, call).code, 4) << "deadline " << ms << " ms";
    // Until the server has recorded the outcome: the compute goes on past the deadline, over 10 s
    // on a loaded 2-core machine (ctest -j2 beside the container build), so wait up to 60 s.
    int idle_polls = 0;
    for (int i = 0; i < 1200 && idle_polls < 20; ++i) {
      m = Metrics(*server);
      if (Counter(m, ok) + Counter(m, late) > 0) break;
      idle_polls = Counter(m, in_flight) == 0 ? idle_polls + 1 : 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (Counter(m, ok) + Counter(m, late) > 0) break;
  }
  std::string attend_lines;
  std::istringstream lines(m);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("attnserve_requests_", 0) == 0 && line.find("Attend\"") != line.npos)
      attend_lines += line + "\n";
  EXPECT_EQ(Counter(m, ok), 0) << attend_lines;
  EXPECT_EQ(Counter(m, late), 1) << attend_lines;
}

// A proxy (nginx) does not watch health and keeps sending unary calls to a draining replica until
// gRPC's GOAWAY tells it to stop. The drain's hand-off serves those calls (answering them costs
// nothing; refusing them sent the proxy's retries back to the same replica), and a sender that
// never stops must not hold the drain longer than the hand-off: then gRPC stops. Here: clients
// without health checking that keep calling through the whole shutdown, backing off 50 ms after a
// failure as attnserve's service configs do (without it a CPU-starved client that had not yet read
// the GOAWAY sent call after call into the stopping server: up to 87 CANCELLED beside 4 CPU hogs).
TEST(DeadlineTest, UnaryCallsDuringTheDrainHandOffAreServedAndDoNotHoldTheDrain) {
  auto server = StartServer([](ServerOptions& o) {
    o.metrics_address = "";
    o.shutdown_grace_seconds = 10;
  });
  ASSERT_TRUE(server);
  auto stub = StubFor(*server);
  std::atomic<bool> stop{false}, draining{false};
  std::mutex mu;
  std::map<int, int> before, during;  // Outcome code -> calls, by when the call started.
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<uint32_t>(40 + t));
      const v1::AttendRequest request = WireRequest(rng, 0, {1, 8, 512});
      while (!stop) {
        const bool started_draining = draining;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        v1::AttendResponse response;
        const grpc::Status s = stub->Attend(&ctx, request, &response);
        {
          std::lock_guard<std::mutex> lock(mu);
          ++(started_draining ? during : before)[s.error_code()];
        }
        if (!s.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }
  // Served before the drain: every client has had an answer.
  const auto served = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return before[grpc::StatusCode::OK] >= 3;
  };
  testing::WaitUntil(served, std::chrono::seconds(30));
  draining = true;
  const double took = TimedShutdown(*server, std::chrono::seconds(20));
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_GE(took, 0) << "Shutdown hung";
  EXPECT_LT(took, 4) << "the clients that never stop held the drain (hand-off: 1 s, grace: 10 s)";
  EXPECT_GT(before[grpc::StatusCode::OK], 0);
  EXPECT_GT(during[grpc::StatusCode::OK], 0) << "no call was served during the hand-off";
  for (const auto& [code, n] : during) {
    // After gRPC stops, calls find no server (UNAVAILABLE); the few that reach it as it stops are
    // cancelled by gRPC itself (CANCELLED, retried by attnserve's service configs).
    EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::UNAVAILABLE ||
                code == grpc::StatusCode::CANCELLED)
        << n << " calls got code " << code;
  }
  EXPECT_LE(during[grpc::StatusCode::CANCELLED], 3);
}

// 3: unary calls racing the shutdown get OK or UNAVAILABLE, never CANCELLED. Each client stops at
// its first UNAVAILABLE, as one that fails over to another replica does.
TEST(DeadlineTest, UnaryCallsRacingShutdownGetOkOrUnavailable) {
  for (int round = 0; round < 3; ++round) {
    auto server = StartServer([](ServerOptions& o) { o.metrics_address = ""; });
    ASSERT_TRUE(server);
    Client client(testing::TargetOf(*server));
    std::mutex mu;
    std::map<int, int> codes;
    std::vector<std::thread> threads;
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(static_cast<uint32_t>(t));
        AttendRequest r;
        r.query = RandomTensor(rng, {1, 8, 512});
        for (int n = 0; n < 100000; ++n) {
          AttendResult out;
          const CallStatus s = client.Attend(r, &out);
          std::lock_guard<std::mutex> lock(mu);
          ++codes[s.code];
          if (!s.ok()) break;
        }
      });
    }
    // Calls are being answered when the shutdown comes.
    const auto answering = [&] {
      std::lock_guard<std::mutex> lock(mu);
      return codes[0] >= 6;
    };
    testing::WaitUntil(answering, std::chrono::seconds(30));
    server->Shutdown();
    for (auto& t : threads) t.join();
    EXPECT_GT(codes[0], 0);
    for (const auto& [code, n] : codes) {
      EXPECT_TRUE(code == 0 || code == 14) << n << " calls got code " << code;
    }
  }
}

// --lingering-close: on (the default), a stopping server holds its client connections until they
// are read; off, it holds none and they close as gRPC closes them.
TEST(LingeringCloseTest, ConnectionsAreHeldOnStopOnlyWhenItIsOn) {
  for (const bool on : {true, false}) {
    auto server = StartServer([on](ServerOptions& o) { o.lingering_close = on; });
    ASSERT_TRUE(server);
    auto stub = StubFor(*server);
    grpc::ClientContext ctx;
    v1::ListModelsResponse models;
    ASSERT_TRUE(stub->ListModels(&ctx, v1::ListModelsRequest(), &models).ok());
    const std::shared_ptr<const ShutdownOutcome> outcome = server->shutdown_outcome();
    EXPECT_GE(TimedShutdown(*server, std::chrono::seconds(20)), 0) << "Shutdown hung";
    if (on) {
      EXPECT_GE(outcome->connections_held.load(), 1) << "the client's connection was not held";
    } else {
      EXPECT_EQ(outcome->connections_held.load(), 0);
    }
    EXPECT_EQ(outcome->connections_unread.load(), 0);
  }
}

}  // namespace
}  // namespace attnserve
