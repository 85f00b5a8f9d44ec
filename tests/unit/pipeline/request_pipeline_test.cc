// RequestPipeline without a server: the request path every front end shares, driven directly with
// decoded messages and a real repository (the demo model), batcher and store. Numbers are checked
// against the float64 reference (tests/lib/mha_reference.h) with fresh random inputs of a fixed
// seed; relative tolerance 1e-4 (float32 over E=512).
#include "server/pipeline/request_pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "server/models/model_loader.h"
#include "tests/lib/mha_reference.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::Vec;

class RequestPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(FlowLimits{}); }

  // `tune`, when given, changes the batcher's options (one worker) before it starts.
  void Build(const FlowLimits& flow, const KvOptions& kv = {},
             const std::function<void(BatcherOptions*)>& tune = {}) {
    pipeline_.reset();
    auto opened = ModelRepository::Open("", EngineOptions());
    ASSERT_TRUE(opened.ok()) << opened.status().message();
    models_ = std::move(*opened);
    BatcherOptions options;
    options.workers = 1;
    if (tune) tune(&options);
    batcher_ = std::make_unique<Batcher>(options);
    kv_ = std::make_unique<KvStore>(kv);
    pipeline_ = std::make_unique<RequestPipeline>(*models_, *batcher_, metrics_, AttendLimits{},
                                                  flow, *kv_);
  }

  // A request for the demo model with a random [1, len, 512] query (its values in *query).
  v1::AttendRequest Request(int64_t len, Vec* query = nullptr) {
    std::vector<float> values = testing::RandomFloats(rng_, static_cast<size_t>(len * 512));
    if (query) query->assign(values.begin(), values.end());
    v1::AttendRequest r;
    r.set_request_id(static_cast<uint64_t>(1000 + len));
    r.set_model("demo");
    r.mutable_query()->set_dtype(v1::DATA_TYPE_FLOAT32);
    for (int64_t d : {int64_t{1}, len, int64_t{512}}) r.mutable_query()->add_shape(d);
    r.mutable_query()->set_data(values.data(), values.size() * sizeof(float));
    return r;
  }

  // A request's exchange, as a front end decodes it.
  static std::unique_ptr<Exchange> Decoded(v1::AttendRequest r) {
    auto x = std::make_unique<Exchange>();
    x->request = std::move(r);
    return x;
  }

  // Attend until `done` ran: the answered request, not yet delivered.
  Answered Attend(std::unique_ptr<Exchange> x, CallContext call = {}) {
    std::promise<Answered> told;
    pipeline_->Attend("Attend", std::move(x), std::move(call),
                      [&](Answered a) { told.set_value(std::move(a)); });
    return told.get_future().get();
  }

  // Attend `r` and deliver what the pipeline says: the status the client is told.
  Status Told(v1::AttendRequest r, CallContext call = {}) {
    Answered a = Attend(Decoded(std::move(r)), std::move(call));
    const Status st = a.status();
    a.Deliver(st);
    return st;
  }

  // attnserve_requests_total for method Attend with this code.
  double Requests(const std::string& code) {
    double n = 0;
    for (const auto& family : registry_.Collect()) {
      if (family.name != "attnserve_requests_total") continue;
      for (const auto& m : family.metric) {
        bool attend = false, coded = false;
        for (const auto& l : m.label) {
          attend |= l.name == "method" && l.value == "Attend";
          coded |= l.name == "code" && l.value == code;
        }
        if (attend && coded) n += m.counter.value;
      }
    }
    return n;
  }

  bool Idle() { return pipeline_->WaitIdle(SteadyClock::now() + std::chrono::seconds(2), {}); }

  // The sum of a metric's samples (its gauges' values) in the registry; -1 when it has none.
  double Gauge(const std::string& name) {
    double sum = -1;
    for (const prometheus::MetricFamily& f : registry_.Collect()) {
      if (f.name != name) continue;
      for (const prometheus::ClientMetric& m : f.metric) sum = std::max(sum, 0.0) + m.gauge.value;
    }
    return sum;
  }

  std::mt19937 rng_{20261124};
  prometheus::Registry registry_;
  ServerMetrics metrics_{registry_};
  std::unique_ptr<ModelRepository> models_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<RequestPipeline> pipeline_;
};

TEST_F(RequestPipelineTest, AnswersLikeTheFloat64ReferenceWithTheRequestsFieldsInTheAnswer) {
  Vec query;
  v1::AttendRequest r = Request(5, &query);
  r.set_attn_weights(v1::ATTN_WEIGHTS_PER_HEAD);
  CallContext call;
  call.previous_attempts = 2;
  Answered answered = Attend(Decoded(std::move(r)), call);
  ASSERT_TRUE(answered.status().ok()) << answered.status().ToString();
  const Exchange& x = *answered.get();

  const v1::AttendResponse& meta = x.answer.meta;
  EXPECT_EQ(meta.request_id(), 1005u);
  EXPECT_EQ(meta.model(), "demo");
  EXPECT_EQ(meta.model_version(), 1);
  EXPECT_EQ(meta.timing().previous_attempts(), 2u);
  EXPECT_THAT(meta.output().shape(), ::testing::ElementsAre(1, 5, 512));
  EXPECT_THAT(meta.attn_weights().shape(), ::testing::ElementsAre(1, 8, 5, 5));
  EXPECT_EQ(x.model, "demo");

  Vec out, weights;
  testing::Reference(DemoModelWeights(), 1, 5, 5, query, query, query, {}, &out, &weights);
  ASSERT_NE(x.answer.output, nullptr);
  ASSERT_NE(x.answer.weights, nullptr);
  EXPECT_LT(testing::RelativeError(*x.answer.output, std::vector<float>(out.begin(), out.end())),
            1e-4);
  EXPECT_LT(
      testing::RelativeError(*x.answer.weights, std::vector<float>(weights.begin(), weights.end())),
      1e-4);
  answered.Deliver(Status::Ok());
  EXPECT_EQ(answered.get(), nullptr);  // Delivered: the exchange is freed.
  EXPECT_TRUE(Idle());
}

// A request whose tensors were decoded into staging (a CUDA server's front end): the engine reads
// them there, the in-flight budget counts them, and they go back to the staging once computed.
TEST_F(RequestPipelineTest, StagedInputsAreReadFromTheStagingAndGivenBackOnceComputed) {
  HostStaging staging(int64_t{1} << 20, /*pinned=*/false);
  Vec query;
  auto owned = Decoded(Request(6, &query));
  Exchange& x = *owned;
  const std::string bytes = x.request.query().data();
  char* block = nullptr;
  std::shared_ptr<void> owner = staging.Allocate(bytes.size(), &block);
  ASSERT_NE(owner, nullptr);
  std::memcpy(block, bytes.data(), bytes.size());
  x.staged.query = {std::move(owner), block, bytes.size()};
  x.request.mutable_query()->clear_data();  // As the staged decode leaves it.
  Answered answered = Attend(std::move(owned));
  ASSERT_TRUE(answered.status().ok());
  EXPECT_EQ(staging.held_bytes(), 0);  // Computed: the block went back.
  EXPECT_GE(answered->held_bytes, static_cast<int64_t>(2 * bytes.size()));  // Request and answer.
  Vec out;
  Vec weights;
  testing::Reference(DemoModelWeights(), 1, 6, 6, query, query, query, {}, &out, &weights);
  ASSERT_NE(answered->answer.output, nullptr);
  EXPECT_LT(
      testing::RelativeError(*answered->answer.output, std::vector<float>(out.begin(), out.end())),
      1e-4);
  answered.Deliver(Status::Ok());
}

TEST_F(RequestPipelineTest, RefusesWhatItCannotResolveNamingTheFieldAndWhatIsThere) {
  struct Case {
    std::function<void(v1::AttendRequest*)> change;
    StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {[](v1::AttendRequest* r) { r->set_model("nope"); }, StatusCode::kNotFound,
       "model: 'nope' is not loaded; available: demo"},
      {[](v1::AttendRequest* r) { r->set_model_version(-1); }, StatusCode::kInvalidArgument,
       "model_version: -1"},
      {[](v1::AttendRequest* r) { r->set_model_version(7); }, StatusCode::kNotFound,
       "loaded versions: 1"},
      {[](v1::AttendRequest* r) { r->set_model_version(INT64_MAX); }, StatusCode::kNotFound,
       "loaded versions: 1"},
      {[](v1::AttendRequest* r) { r->set_memory("m"), r->set_session("s"); },
       StatusCode::kInvalidArgument, "memory, session: a request names one or the other"},
      {[](v1::AttendRequest* r) { r->set_session("0123"); }, StatusCode::kNotFound, "session"},
      {[](v1::AttendRequest* r) { r->mutable_query()->clear_shape(); },
       StatusCode::kInvalidArgument, "query"},
  };
  for (const Case& c : cases) {
    v1::AttendRequest r = Request(3);
    c.change(&r);
    const Status st = Told(std::move(r));
    EXPECT_EQ(st.code(), c.code) << st.ToString();
    EXPECT_THAT(st.message(), HasSubstr(c.says));
  }
  EXPECT_TRUE(Idle());  // Every refusal was counted out again.
}

TEST_F(RequestPipelineTest, RefusesBytesOverTheInFlightBudgetOnlyWhileOthersHoldIt) {
  FlowLimits flow;
  flow.max_inflight_bytes = 20'000;  // A request of 4 tokens holds 2 x 8 KiB plus its fields.
  Build(flow);
  Answered first = Attend(Decoded(Request(4)));  // Held until delivered.
  ASSERT_TRUE(first.status().ok());
  const Status refused = Told(Request(4));
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("--max-inflight-bytes"));
  EXPECT_FALSE(pipeline_->WaitIdle(SteadyClock::now() + std::chrono::milliseconds(50), {}));
  first.Deliver(Status::Ok());
  EXPECT_TRUE(Told(Request(4)).ok());
  EXPECT_TRUE(Idle());
}

TEST_F(RequestPipelineTest, EachCallerHoldsAtMostItsShareAndAHandedAnswerStaysCountedUntilTaken) {
  FlowLimits flow;
  flow.max_inflight_bytes = 100'000;
  flow.max_inflight_bytes_per_caller = 20'000;  // One request of 4 tokens (~17 KB) a caller.
  Build(flow);
  CallContext a, b;
  a.peer = "10.0.0.1";
  b.peer = "10.0.0.2";
  Answered first = Attend(Decoded(Request(4)), a);
  ASSERT_TRUE(first.status().ok());
  Answered again = Attend(Decoded(Request(4)), a);
  EXPECT_EQ(again.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(again.status().message(), HasSubstr("caller 'default@10.0.0.1'"));
  EXPECT_THAT(again.status().message(), HasSubstr("--max-inflight-bytes-per-caller"));
  again.Deliver(again.status());
  Answered other = Attend(Decoded(Request(4)), b);  // Another address has a share of its own.
  EXPECT_TRUE(other.status().ok()) << other.status().ToString();
  other.Deliver(other.status());
  // Handed to the transport: recorded, but its bytes are the caller's until the token goes.
  HeldBytes held = first.Hand(Status::Ok());
  EXPECT_EQ(Attend(Decoded(Request(4)), a).status().code(), StatusCode::kResourceExhausted);
  held = HeldBytes();
  Answered after = Attend(Decoded(Request(4)), a);
  EXPECT_TRUE(after.status().ok()) << after.status().ToString();
  after.Deliver(after.status());
  EXPECT_TRUE(Idle());
}

TEST_F(RequestPipelineTest, TheInFlightBytesGaugeHoldsAnAnswersBytesUntilTheTransportLetsThemGo) {
  // What a test (or an operator) waits on for the budget to be free: requests_in_flight reads 0 as
  // soon as an answer is handed to the transport, while its bytes stay held until it is sent.
  EXPECT_EQ(Gauge("attnserve_inflight_bytes"), 0);
  Answered first = Attend(Decoded(Request(4)));
  ASSERT_TRUE(first.status().ok());
  const double held = Gauge("attnserve_inflight_bytes");
  EXPECT_GT(held, 2 * 4 * 512 * 4);  // The query and the answer, at least.
  HeldBytes sending = first.Hand(Status::Ok());
  EXPECT_EQ(Gauge("attnserve_requests_in_flight"), 0);
  EXPECT_EQ(Gauge("attnserve_inflight_bytes"), held);
  sending = HeldBytes();
  EXPECT_EQ(Gauge("attnserve_inflight_bytes"), 0);
  // A refused request holds nothing.
  FlowLimits flow;
  flow.max_inflight_bytes = 20'000;
  Build(flow);
  Answered again = Attend(Decoded(Request(4)));
  ASSERT_TRUE(again.status().ok());
  EXPECT_EQ(Told(Request(4)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Gauge("attnserve_inflight_bytes"), held);
  again.Deliver(Status::Ok());
  EXPECT_EQ(Gauge("attnserve_inflight_bytes"), 0);
}

TEST_F(RequestPipelineTest, CallersAreTheirTenantOrTheirPeerAddress) {
  CallContext call;
  call.peer = "10.0.0.1";
  EXPECT_EQ(pipeline_->CallerOf(call), "default@10.0.0.1");
  call.tenant = "acme";
  EXPECT_EQ(pipeline_->CallerOf(call),
            "acme");  // A named tenant is one caller wherever it calls from.
  call.tenant = kDefaultTenant;
  pipeline_->SetCallerByPeer(false);
  EXPECT_EQ(pipeline_->CallerOf(call), "default");
}

TEST_F(RequestPipelineTest, ASessionStepTheClientCannotReceiveIsNotApplied) {
  v1::OpenSessionRequest open;
  open.set_model("demo");
  open.set_batch(1);
  v1::KvHandle handle;
  ASSERT_TRUE(pipeline_->OpenSession(open, &handle, {}, nullptr).ok());

  const auto step = [&](CallContext call) {
    v1::AttendRequest r = Request(2);
    r.set_model("");
    r.set_session(handle.handle());
    Answered a = Attend(Decoded(std::move(r)), std::move(call));
    const Status st = a.status();
    const int64_t length = a->answer.meta.session_length();
    a.Deliver(st);
    return std::make_pair(st, length);
  };
  CallContext late;
  late.deadline = SteadyClock::now();  // Passed before compute, or during it: either way too late.
  EXPECT_EQ(step(late).first.code(), StatusCode::kDeadlineExceeded);
  CallContext gone;
  gone.cancelled = [] { return true; };
  EXPECT_EQ(step(gone).first.code(), StatusCode::kCancelled);
  // A cancellation that arrives as the deadline is due is the client's deadline (which reaches
  // the server as a cancellation, before the server's copy of it passes).
  CallContext due;
  due.deadline = SteadyClock::now() + std::chrono::milliseconds(50);
  due.cancelled = [] { return true; };
  EXPECT_EQ(step(due).first.code(), StatusCode::kDeadlineExceeded);
  const auto [st, length] = step({});
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(length, 2);  // Neither refused step was kept.

  v1::ReleaseRequest close;
  close.set_handle(handle.handle());
  v1::ReleaseResponse freed;
  EXPECT_TRUE(
      pipeline_->Release("CloseSession", KvKind::kSession, close, &freed, {}, nullptr).ok());
  EXPECT_GT(freed.bytes_freed(), 0);
  EXPECT_EQ(pipeline_->Release("CloseSession", KvKind::kSession, close, &freed, {}, nullptr).code(),
            StatusCode::kNotFound);
  EXPECT_TRUE(Idle());
}

// A client is told its answer only once the request has let go of its memory or session, so the
// client's next call can evict it at once: no RESOURCE_EXHAUSTED for room that only an answered
// request still held. The probe runs where the client is told (in `done`): it needs room that only
// evicting the request's memory or session makes.
TEST_F(RequestPipelineTest, AnAnsweredRequestNoLongerHoldsItsMemoryOrSession) {
  KvOptions kv;
  kv.budget_bytes = 60000;  // One 10-token memory of the demo model is 41,000 bytes.
  kv.max_entry_bytes = 60000;
  Build(FlowLimits{}, kv);
  auto model = models_->Snapshot()->Lookup("demo", 0);
  ASSERT_TRUE(model.ok());
  const auto evicts_the_rest = [&]() -> Status {
    auto probe =
        kv_->Create(KvKind::kMemory, *model, (*model)->NewKvCache(), 1, 10, kDefaultTenant);
    if (!probe.ok()) return probe.status();
    RETURN_IF_ERROR(kv_->MarkReady(*probe, 10));
    const std::string handle = (*probe)->handle;
    probe->reset();
    return kv_->Release(handle, KvKind::kMemory, kDefaultTenant).status();
  };
  const auto create_memory = [&](v1::KvHandle* handle, bool probe) {
    v1::CreateMemoryRequest req;
    req.set_model("demo");
    const v1::AttendRequest kv_tokens = Request(10);
    *req.mutable_key() = kv_tokens.query();
    *req.mutable_value() = kv_tokens.query();
    std::promise<std::pair<Status, Status>> told;
    pipeline_->CreateMemory(req, {}, handle, [&](const Status& st, const CallTrace&) {
      told.set_value({st, probe ? evicts_the_rest() : Status::Ok()});
    });
    return told.get_future().get();
  };
  const auto attend = [&](v1::AttendRequest r) {
    std::promise<std::pair<Status, Status>> told;
    pipeline_->Attend("Attend", Decoded(std::move(r)), {}, [&](Answered a) {
      a.Deliver(a.status());
      told.set_value({a.status(), evicts_the_rest()});
    });
    return told.get_future().get();
  };

  v1::KvHandle memory;
  auto [created, probe1] = create_memory(&memory, true);
  ASSERT_TRUE(created.ok()) << created.ToString();
  EXPECT_TRUE(probe1.ok()) << "told CreateMemory's answer: " << probe1.ToString();

  ASSERT_TRUE(create_memory(&memory, false).first.ok());  // The probe evicted the first.
  v1::AttendRequest read = Request(3);
  read.set_model("");
  read.set_memory(memory.handle());
  auto [answered, probe2] = attend(std::move(read));
  ASSERT_TRUE(answered.ok()) << answered.ToString();
  EXPECT_TRUE(probe2.ok()) << "told an answer from a memory: " << probe2.ToString();

  v1::OpenSessionRequest open;
  open.set_model("demo");
  open.set_batch(1);
  v1::KvHandle session;
  ASSERT_TRUE(pipeline_->OpenSession(open, &session, {}, nullptr).ok());
  v1::AttendRequest step = Request(8);
  step.set_model("");
  step.set_session(session.handle());
  auto [stepped, probe3] = attend(std::move(step));
  ASSERT_TRUE(stepped.ok()) << stepped.ToString();
  EXPECT_TRUE(probe3.ok()) << "told a session step's answer: " << probe3.ToString();
  EXPECT_TRUE(Idle());
}

TEST_F(RequestPipelineTest, DrainClosesOpenCallsAndWaitIdleWaitsForThem) {
  struct FakeCall : OpenCall {
    RequestPipeline* pipeline = nullptr;
    int drains = 0;
    bool finished = false;
    bool Drain() override { return ++drains == 1; }
    void FinishNow() override {
      finished = true;
      pipeline->RemoveCall(this);
    }
  } call;
  call.pipeline = pipeline_.get();
  pipeline_->AddCall(&call);
  EXPECT_FALSE(pipeline_->draining());
  EXPECT_FALSE(pipeline_->WaitIdle(SteadyClock::now() + std::chrono::milliseconds(50), {}));
  pipeline_->BeginDrain();
  EXPECT_TRUE(pipeline_->draining());
  EXPECT_EQ(call.drains, 1);
  EXPECT_TRUE(call.finished);
  EXPECT_TRUE(Idle());
  // Single requests are still served while draining.
  EXPECT_TRUE(Told(Request(1)).ok());
}

// The handle a front end gets back records the request's ending once on every path: delivered
// (twice: once), let go of undelivered (recorded as not delivered, by the call's deadline), moved
// (the new owner records), or replaced by another (the replaced one recorded). After each, the
// in-flight count is back to zero, so a stop does not wait out its grace period.
TEST_F(RequestPipelineTest, EveryAnsweredRequestIsRecordedExactlyOnceOnEveryPath) {
  {
    Answered a = Attend(Decoded(Request(2)));
    ASSERT_TRUE(a.status().ok());
    a.Deliver(Status::Ok());
    a.Deliver(Status(StatusCode::kInternal, "a second delivery"));  // Nothing more.
  }
  EXPECT_EQ(Requests("OK"), 1);
  EXPECT_EQ(Requests("INTERNAL"), 0);
  EXPECT_TRUE(Idle());
  { Answered dropped = Attend(Decoded(Request(2))); }  // A front end that forgot to deliver.
  EXPECT_EQ(Requests("CANCELLED"), 1);
  EXPECT_TRUE(Idle());
  {
    CallContext call;
    call.deadline = SteadyClock::now() + std::chrono::seconds(30);
    Answered a = Attend(Decoded(Request(2)), call);
    Answered moved = std::move(a);
    EXPECT_EQ(a.get(), nullptr);
    EXPECT_FALSE(pipeline_->WaitIdle(SteadyClock::now() + std::chrono::milliseconds(20), {}));
    moved = Attend(Decoded(Request(3)));  // The one it held is let go of: CANCELLED.
    EXPECT_EQ(Requests("CANCELLED"), 2);
    moved.Deliver(Status::Ok());
  }
  EXPECT_EQ(Requests("OK"), 2);
  EXPECT_TRUE(Idle());
  {
    // Let go of once the call's deadline passed: the client saw its deadline pass.
    CallContext call;
    call.deadline = SteadyClock::now() + std::chrono::milliseconds(500);
    Answered a = Attend(Decoded(Request(2)), call);
    ASSERT_TRUE(a.status().ok()) << a.status().ToString();
    std::this_thread::sleep_until(call.deadline + std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Requests("DEADLINE_EXCEEDED"), 1);
  EXPECT_EQ(Requests("CANCELLED"), 2);
  EXPECT_EQ(Requests("OK"), 2);
  EXPECT_TRUE(Idle());
}

// A tenant capped at best_priority_level 2 that asks for priority 1 is queued at level 2, behind
// the level-2 request queued before it, and its answer records level 2; an uncapped tenant's
// priority 1 still goes first. The one worker is held in the first batch while the others queue,
// and each request is a batch of its own, so the order batches run in is the order the queue serves
// them.
TEST_F(RequestPipelineTest, ACappedTenantIsQueuedAtItsBestLevelNotAheadOfThatLevel) {
  struct Served {
    std::mutex mu;
    std::vector<std::string> order;  // "tenant@level", batch by batch.
    std::promise<void> computing, release;
    std::shared_future<void> released = release.get_future().share();
  };
  auto served = std::make_shared<Served>();
  Build(FlowLimits{}, {}, [served](BatcherOptions* o) {
    o->enabled = false;
    o->scheduling = BatcherOptions::Scheduling::kFcfs;
    o->priorities.levels = 2;
    o->on_batch = [served](const std::string&, const std::vector<WorkItem*>& batch, double) {
      bool first = false;
      {
        std::lock_guard<std::mutex> lock(served->mu);
        first = served->order.empty();
        for (const WorkItem* w : batch)
          served->order.push_back(w->tenant + "@" + std::to_string(w->level));
      }
      if (first) {
        served->computing.set_value();
        served->released.wait();
      }
    };
  });
  auto tenants =
      Tenants::Parse(R"({"tenants": {"low": {"best_priority_level": 2}, "high": {}}})", "t.json");
  ASSERT_TRUE(tenants.ok()) << tenants.status().message();
  pipeline_->SetTenants(*tenants);
  auto send = [this](const std::string& tenant, uint64_t priority) {
    auto told = std::make_shared<std::promise<Answered>>();
    std::future<Answered> answer = told->get_future();
    v1::AttendRequest r = Request(4);
    r.set_priority(priority);
    CallContext call;
    call.tenant = tenant;
    pipeline_->Attend("Attend", Decoded(std::move(r)), std::move(call),
                      [told](Answered a) { told->set_value(std::move(a)); });
    return answer;
  };
  std::vector<std::future<Answered>> answers;
  answers.push_back(send("first", 1));
  const bool held = served->computing.get_future().wait_for(std::chrono::seconds(30)) ==
                    std::future_status::ready;
  if (held) {
    answers.push_back(send("high", 2));
    answers.push_back(send("low", 1));  // Asks for level 1; capped at 2.
    answers.push_back(send("high", 1));
  }
  served->release.set_value();
  ASSERT_TRUE(held) << "the first request never computed";
  std::vector<int64_t> levels;
  for (auto& f : answers) {
    Answered a = f.get();
    ASSERT_TRUE(a.status().ok()) << a.status().ToString();
    levels.push_back(a.get()->level);  // What the span and the access log record.
    a.Deliver(Status::Ok());
  }
  EXPECT_THAT(levels, ::testing::ElementsAre(1, 2, 2, 1));
  std::lock_guard<std::mutex> lock(served->mu);
  EXPECT_THAT(served->order, ::testing::ElementsAre("first@1", "high@1", "high@2", "low@2"));
}

// What a request whose answer cannot be delivered is counted as: the client's deadline (which
// reaches the server as a cancellation, possibly before the server's copy of it passes) or the
// client's own cancellation.
TEST(UndeliveredTest, TheDeadlineWhenItPassedOrIsDueElseTheClientsCancellation) {
  using std::chrono::milliseconds;
  const auto now = SteadyClock::now();
  EXPECT_EQ(UndeliveredBy(now - milliseconds(1)).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(UndeliveredBy(now + milliseconds(50)).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(UndeliveredBy(now + std::chrono::seconds(10)).code(), StatusCode::kCancelled);
  EXPECT_EQ(UndeliveredBy(SteadyClock::time_point::max()).code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace attnserve
