// The trace room: W3C traceparent parsing, parent-based sampling, and the exporter's bounded queue
// against a collector that is not there.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "server/trace/otlp_exporter.h"
#include "server/trace/trace_context.h"
#include "server/trace/tracer.h"

namespace attnserve {
namespace {

const std::string kTrace = "4bf92f3577b34da6a3ce929d0e0e4736";
const std::string kSpan = "00f067aa0ba902b7";

TEST(TraceparentTest, ReadsAValidOneAndItsFlags) {
  auto p = ParseTraceparent("00-" + kTrace + "-" + kSpan + "-01");
  ASSERT_TRUE(p);
  EXPECT_EQ(Hex(p->trace_id), kTrace);
  EXPECT_EQ(Hex(p->span_id), kSpan);
  EXPECT_TRUE(p->sampled());
  auto q = ParseTraceparent("00-" + kTrace + "-" + kSpan + "-00");
  ASSERT_TRUE(q);
  EXPECT_FALSE(q->sampled());
  EXPECT_EQ(FormatTraceparent(p->trace_id, p->span_id, p->flags),
            "00-" + kTrace + "-" + kSpan + "-01");
}

TEST(TraceparentTest, ALaterVersionIsReadAsLevelOneWithItsExtraFieldsIgnored) {
  auto p = ParseTraceparent("01-" + kTrace + "-" + kSpan + "-03-whatever");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->flags, 1);  // only the sampled flag is known
  EXPECT_FALSE(ParseTraceparent("01-" + kTrace + "-" + kSpan + "-01x"));
}

TEST(TraceparentTest, RefusesEveryMalformedShape) {
  const std::string ok_tail = "-" + kSpan + "-01";
  for (const std::string bad : {
           "ff-" + kTrace + ok_tail,                             // version ff
           "00-" + kTrace + ok_tail + "-extra",                  // version 00 with more
           "00-" + kTrace.substr(2) + ok_tail,                   // short trace id
           "00-" + kTrace + "-" + kSpan.substr(1) + "-01",       // short span id
           "00-" + kTrace + "-" + kSpan + "0-01",                // long span id
           "00-" + kTrace.substr(1) + "g" + ok_tail,             // non-hex
           "00-4BF92F3577B34DA6A3CE929D0E0E4736" + ok_tail,      // uppercase
           "00-" + std::string(32, '0') + ok_tail,               // zero trace id
           "00-" + kTrace + "-" + std::string(16, '0') + "-01",  // zero span id
           "00_" + kTrace + "_" + kSpan + "_01",                 // separators
           "0-" + kTrace + ok_tail + "0",                        // one-digit version
           std::string(),
           "00-" + std::string(8192, 'a'),
       }) {
    EXPECT_FALSE(ParseTraceparent(bad)) << bad.substr(0, 80);
  }
}

TEST(TraceparentTest, TracestateIsKeptOnlyBesideAValidParentAndWithinItsBound) {
  const std::string parent = "00-" + kTrace + "-" + kSpan + "-01";
  EXPECT_EQ(ReadIncoming(parent, "a=1,b=2").tracestate, "a=1,b=2");
  EXPECT_EQ(ReadIncoming("garbage", "a=1").tracestate, "");
  EXPECT_FALSE(ReadIncoming("garbage", "a=1").parent);
  EXPECT_EQ(ReadIncoming(parent, std::string(kMaxTracestate + 1, 'x')).tracestate, "");
}

class CountingSink final : public SpanSink {
 public:
  void Export(SpanData) override { ++spans; }
  int spans = 0;
};

TEST(TracerTest, ParentBasedSamplingWithARatioForTheRest) {
  CountingSink sink;
  const IncomingTrace sampled = ReadIncoming("00-" + kTrace + "-" + kSpan + "-01", "");
  const IncomingTrace unsampled = ReadIncoming("00-" + kTrace + "-" + kSpan + "-00", "");
  for (double rate : {0.0, 1.0}) {
    Tracer tracer(rate, &sink);
    const CallTrace a = tracer.Begin(sampled);
    EXPECT_TRUE(a.sampled);
    EXPECT_EQ(Hex(a.trace_id), kTrace);
    EXPECT_EQ(Hex(a.parent), kSpan);
    EXPECT_FALSE(tracer.Begin(unsampled).sampled) << "the caller said not sampled";
    const CallTrace fresh = tracer.Begin({});
    EXPECT_EQ(fresh.sampled, rate == 1.0);
    EXPECT_TRUE(IsZero(fresh.parent.data(), 8));
    EXPECT_NE(Hex(fresh.trace_id), kTrace);
  }
  Tracer half(0.25, &sink);
  int n = 0;
  for (int i = 0; i < 20000; ++i) n += half.Begin({}).sampled;
  EXPECT_NEAR(n / 20000.0, 0.25, 0.02);  // 20,000 draws: the standard error is 0.003
  Tracer off(1.0, nullptr);
  EXPECT_FALSE(off.Begin(sampled).on);
  EXPECT_FALSE(off.Begin(sampled).sampled);
}

TEST(TracerTest, ChildrenTakeTheCallsTraceAndItsSpanAsParent) {
  CountingSink sink;
  Tracer tracer(1.0, &sink);
  const CallTrace call = tracer.Begin(ReadIncoming("00-" + kTrace + "-" + kSpan + "-01", "k=v"));
  const auto t0 = Tracer::Clock::now();
  const SpanData child =
      tracer.ChildOf(call, "attnserve.queue", t0, t0 + std::chrono::milliseconds(2));
  const SpanData server = tracer.ServerSpan(call, "x/y", t0, t0 + std::chrono::milliseconds(3));
  EXPECT_EQ(child.trace_id, call.trace_id);
  EXPECT_EQ(child.parent_span_id, call.span_id);
  EXPECT_EQ(server.span_id, call.span_id);
  EXPECT_EQ(Hex(server.parent_span_id), kSpan);
  EXPECT_EQ(server.tracestate, "k=v");
  EXPECT_EQ(child.end_unix_nanos - child.start_unix_nanos, 2000000);
  const auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
  EXPECT_NEAR(static_cast<double>(child.start_unix_nanos), static_cast<double>(wall), 5e9);
  const SpanData root = tracer.Root("attnserve.batch", t0, t0);
  EXPECT_TRUE(IsZero(root.parent_span_id.data(), 8));
  EXPECT_NE(root.trace_id, call.trace_id);
}

// A TCP port that listens and never answers (a collector that hangs before HTTP/2 starts).
int SilentListener(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  listen(fd, 16);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

TEST(OtlpExporterTest, AHungCollectorNeverHoldsACallerAndTheQueueStaysBounded) {
  int port = 0;
  const int fd = SilentListener(&port);
  ExporterOptions o;
  o.endpoint = "127.0.0.1:" + std::to_string(port);
  o.max_queue_spans = 100;
  o.max_batch_spans = 10;
  o.interval = std::chrono::milliseconds(10);
  o.timeout = std::chrono::milliseconds(300);
  int64_t dropped_full = 0, dropped_failed = 0;
  std::mutex mu;
  o.on_dropped = [&](int64_t n, const char* why) {
    std::lock_guard<std::mutex> lock(mu);
    (std::string(why) == "queue_full" ? dropped_full : dropped_failed) += n;
  };
  auto exporter = OtlpExporter::Start(o);
  ASSERT_TRUE(exporter.ok()) << exporter.status().ToString();
  for (int i = 0; i < 1000; ++i) (*exporter)->Export(SpanData{});
  {
    std::lock_guard<std::mutex> lock(mu);
    // At most the queue and one batch in the exporter's hands; the rest dropped on the spot.
    EXPECT_GE(dropped_full, 1000 - 100 - 10);
  }
  (*exporter)->Shutdown();  // one last try, bounded by the export timeout
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(dropped_full + dropped_failed, 1000) << "every span is accounted for";
  EXPECT_EQ((*exporter)->exported(), 0);
  close(fd);
}

TEST(OtlpExporterTest, OptionsNameTheFlagAtFault) {
  ExporterOptions o;
  EXPECT_NE(o.Validate().message().find("--trace-endpoint"), std::string::npos);
  o.endpoint = "collector:4317";
  o.tls_ca_file = "/ca.pem";
  EXPECT_NE(o.Validate().message().find("--trace-tls-ca"), std::string::npos);
  o.tls = true;
  o.tls_cert_file = "/cert.pem";
  EXPECT_NE(o.Validate().message().find("--trace-tls-key"), std::string::npos);
  o.tls_cert_file.clear();
  o.tls_ca_file = "/no/such/ca.pem";
  auto started = OtlpExporter::Start(o);
  ASSERT_FALSE(started.ok());
  EXPECT_NE(started.status().message().find("/no/such/ca.pem"), std::string::npos);
}

}  // namespace
}  // namespace attnserve
